"""A received checkpoint is data (issue 33): it never chooses code to run, its names stay inside its folder,
everything read from it is checksummed, `--resume auto` falls back past a damaged step and says so, and a
re-save never leaves the step missing. Each case: one line, exit 2, nothing written.

Each `zoff` call is its own `python -m zoff` process; those that need no training are forked from a server that
has imported zoff and torch once (tests.forked_zoff), and one of them starts a fresh interpreter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.forked_zoff import forked_cli
from zoff.checkpoint.format import file_entry, find_checkpoint, newest_intact, replace_folder
from zoff.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, "-m", "zoff", "train", str(REPO / "configs" / "tiny.yaml"), "log.progress=false",
         "launch.nproc_per_node=1", "checkpoint.every_steps=2", "checkpoint.keep_last=3"]  # fmt: skip


def _zoff(*args: str, cwd: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m zoff ARGS`, forked from the tests' fork server; fresh=True: a new interpreter."""
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "zoff", *args], capture_output=True, text=True, timeout=300, cwd=cwd
        )
    return forked_cli([(list(args), cwd or Path.cwd(), dict(os.environ))], timeout=300)[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real run's folder with checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("trust") / "run"
    p = subprocess.run([*TRAIN, "train.max_steps=6", "--run-dir", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _one_line_exit_2(p: subprocess.CompletedProcess, *needles: str) -> str:
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (p.returncode, err)
    for n in needles:
        assert n in err, err
    return err


def _rehash(step: Path, name: str) -> None:
    """Update the manifest for an edited file: the sender recomputed the checksums (they prove integrity,
    not good intent)."""
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"].update(file_entry(step / name))
    (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("model", "needle"),
    [({"name": "python:os.path:join"}, "names Python code to import"),
     ({"config": {"trust_remote_code": True}}, "model.config.trust_remote_code")],
)  # fmt: skip
def test_convert_never_runs_code_a_checkpoint_names(run, tmp_path, model, needle) -> None:
    step = _copy(run, tmp_path) / "checkpoints" / "step_00000006"
    cfg = yaml.safe_load((step / "config.yaml").read_text())
    cfg["model"].update(model)
    (step / "config.yaml").write_text(yaml.safe_dump(cfg))
    _rehash(step, "config.yaml")
    out = tmp_path / "out"  # (--format hf reads the run's config to build the model; a plain export does not)
    _one_line_exit_2(_zoff("convert", str(step), str(out), "--format", "hf"), needle, "--trust-remote-code")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_an_edited_config_fails_its_checksum(run, tmp_path) -> None:
    step = _copy(run, tmp_path) / "checkpoints" / "step_00000006"
    (step / "config.yaml").write_text((step / "config.yaml").read_text() + "# edited after the save\n")
    p = _zoff("convert", str(step), str(tmp_path / "o.safetensors"), fresh=True)
    _one_line_exit_2(p, "config.yaml")


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".hidden"])
def test_manifest_names_stay_inside_the_folder(run, tmp_path, name) -> None:
    step = _copy(run, tmp_path) / "checkpoints" / "step_00000006"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    (step / "manifest.json").write_text(json.dumps(manifest))
    _one_line_exit_2(_zoff("convert", str(step), str(tmp_path / "o.safetensors")), "not a plain name")


def test_latest_naming_a_folder_outside_is_ignored(run, tmp_path) -> None:
    ckpts = _copy(run, tmp_path) / "checkpoints"
    (tmp_path / "elsewhere").mkdir()
    for name in ("../elsewhere", str(tmp_path / "elsewhere"), "step_00000002/../../elsewhere"):
        (ckpts / "latest").write_text(name + "\n")
        assert find_checkpoint("auto", ckpts) == ckpts / "step_00000006"
    (ckpts / "latest").write_text("step_00000004\n")  # inside: honoured (a rerun's older step)
    assert find_checkpoint("auto", ckpts) == ckpts / "step_00000004"


def test_resume_auto_falls_back_past_a_truncated_step_and_says_why(run, tmp_path) -> None:
    out = _copy(run, tmp_path)
    shard = out / "checkpoints" / "step_00000006" / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    p = subprocess.run([*TRAIN, "train.max_steps=8", "--run-dir", str(out), "--resume", "auto"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--resume auto: skipped step_00000006:" in p.stdout and "truncated or resized" in p.stdout
    assert "resuming from" in p.stdout and "step_00000004" in p.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_resume_auto_with_no_intact_step_is_one_line(run, tmp_path) -> None:
    out = _copy(run, tmp_path)
    for step in (out / "checkpoints").glob("step_*"):
        (step / "extra.safetensors").write_bytes(b"x")
    p = _zoff(
        *TRAIN[3:], "train.max_steps=8", "--run-dir", str(out), "--resume", "auto"
    )  # stops before launch
    _one_line_exit_2(p, "no intact checkpoint", "3 skipped")
    _, skipped = newest_intact(out / "checkpoints", verify=True)
    assert len(skipped) == 3 and all("extra.safetensors" in s for s in skipped)


def test_a_re_save_swaps_the_folder_without_a_moment_missing(tmp_path) -> None:
    final, new = tmp_path / "step_1", tmp_path / ".tmp-step_1"
    final.mkdir()
    (final / "a").write_text("old")
    new.mkdir()
    (new / "a").write_text("new")
    replace_folder(new, final)
    assert (final / "a").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_a_planted_link_is_not_a_checkpoint_file(run, tmp_path) -> None:
    step = _copy(run, tmp_path) / "checkpoints" / "step_00000006"
    target = step / "rng_00000.safetensors"
    moved = tmp_path / "moved.safetensors"
    target.rename(moved)
    target.symlink_to(moved)  # same bytes, but a link the sender planted
    with pytest.raises(UserError, match="missing checkpoint file"):
        from zoff.checkpoint.format import read_manifest

        read_manifest(step, verify=True)


def _edit_manifest(step: Path, edit) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    edit(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [(lambda m: m["params"][0].update(pieces=[]), "its pieces hold 0 of its"),
     (lambda m: m["params"][0]["pieces"][0].update(param_start=10**12), "leave a gap at element 0"),
     (lambda m: m["params"][0].update(shape=[10**7, 10**7]), "larger than any model's parameter"),
     (lambda m: m["params"][0]["pieces"].append(dict(m["params"][0]["pieces"][0])), "overlap")],
    ids=["no-pieces", "param-start-past-the-end", "400TB-shape", "overlapping-pieces"],
)  # fmt: skip
def test_pieces_must_tile_each_parameter_exactly(run, tmp_path, edit, needle) -> None:
    """A parameter with no pieces converted to zeros with exit 0; a piece past its end or a 400 TB shape gave
    a traceback."""
    step = _copy(run, tmp_path) / "checkpoints" / "step_00000006"
    _edit_manifest(step, edit)
    out = tmp_path / "o.safetensors"
    _one_line_exit_2(_zoff("convert", str(step), str(out)), "corrupted manifest", needle)
    assert not out.exists()


def test_a_config_that_is_not_utf8_is_one_line(run, tmp_path) -> None:
    step = _copy(run, tmp_path) / "checkpoints" / "step_00000006"
    (step / "config.yaml").write_bytes(b"model:\n  name: \xff\xfe\n")
    _rehash(step, "config.yaml")
    _one_line_exit_2(_zoff("convert", str(step), str(tmp_path / "out"), "--format", "hf"), "not UTF-8 text")


def test_convert_neither_deletes_nor_follows_a_temporary_name_it_did_not_make(run, tmp_path) -> None:
    step = run / "checkpoints" / "step_00000006"
    out = tmp_path / "o.safetensors"
    precious = tmp_path / ".o.safetensors.tmp"
    precious.write_text("someone's file")
    victim = tmp_path / "victim.txt"
    victim.write_text("victim")
    (tmp_path / ".o2.safetensors.tmp").symlink_to(victim)
    for target in (out, tmp_path / "o2.safetensors"):
        p = _zoff("convert", str(step), str(target))
        assert p.returncode == 0, p.stderr
    assert precious.read_text() == "someone's file" and victim.read_text() == "victim"
    assert not [
        p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and p != precious and not p.is_symlink()
    ]


def test_convert_onto_a_full_or_missing_disk_is_one_line_and_leaves_nothing(
    run, tmp_path, monkeypatch
) -> None:
    import errno

    import zoff.checkpoint.convert as conv
    from zoff.errors import os_error

    step = run / "checkpoints" / "step_00000006"
    _one_line_exit_2(_zoff("convert", str(step), "/proc/o.safetensors"), "cannot write it")

    def full(src, source, tmp, *rest):
        tmp.write_bytes(b"partial")
        raise os_error(
            OSError(errno.ENOSPC, "No space left on device"),
            f"zoff: cannot write {tmp}: No space left on device",
        )

    monkeypatch.setattr(conv, "_write", full)
    out = tmp_path / "o.safetensors"
    with pytest.raises(
        UserError, match=r"o\.safetensors: cannot write it \(cannot write .*No space left on device\)$"
    ):
        conv.convert(step, out)
    assert list(tmp_path.iterdir()) == []  # no OUT, no temporary folder
