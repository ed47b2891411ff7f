"""Sharded checkpoints: bit-exact resume, re-partitioned resume at another world size and stage, integrity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_zoff, tiny_cfg
from zoff.checkpoint.format import find_checkpoint, read_manifest
from zoff.errors import UserError

pytestmark = pytest.mark.slow


def _cfg(stage: int, micro: int, steps: int, every: int, ckpt_dir: Path) -> dict:
    return tiny_cfg(
        zero={"stage": stage, "param_persistence_threshold": 64, "reduce_bucket_size": 3000},
        data={"batch_size": micro},
        train={"max_steps": steps, "grad_accum": 1, "global_batch_size": 12},
        checkpoint={"dir": str(ckpt_dir), "every_steps": every, "keep_last": 5},
    )


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    full = run_zoff(_cfg(2, 6, 30, 15, tmp_path / "a"), 2, tmp_path)[0]
    assert (tmp_path / "a" / "step_00000015" / "manifest.json").is_file()
    assert (tmp_path / "a" / "latest").read_text().strip() == "step_00000030"
    # Resume the same config from step 15 in a fresh checkpoint dir.
    resumed = run_zoff(_cfg(2, 6, 30, 15, tmp_path / "b"), 2, tmp_path, str(tmp_path / "a" / "step_00000015"))
    r = resumed[0]
    assert r["start"] == 15
    assert r["losses"] == full["losses"][15:], "resumed losses must be bit-identical"
    for name, p in full["params"].items():
        assert torch.equal(r["params"][name], p), name


@pytest.mark.parametrize("world,micro,stage", [(3, 4, 3), (1, 12, 0)])
def test_resume_at_other_world_size_and_stage(tmp_path: Path, world: int, micro: int, stage: int) -> None:
    full = run_zoff(_cfg(2, 6, 20, 10, tmp_path / "a"), 2, tmp_path)[0]
    r = run_zoff(
        _cfg(stage, micro, 20, 10, tmp_path / "b"), world, tmp_path, str(tmp_path / "a" / "step_00000010")
    )
    assert r[0]["start"] == 10
    for a, b in zip(r[0]["losses"], full["losses"][10:]):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    run_zoff(_cfg(2, 6, 4, 2, root), 2, root)
    return root


def test_layout_and_manifest(saved: Path) -> None:
    step = saved / "step_00000004"
    names = sorted(p.name for p in step.iterdir())
    assert names == [
        "config.yaml", "extra.safetensors", "manifest.json", "rng_00000.safetensors", "rng_00001.safetensors",
        "shard_00000.safetensors", "shard_00001.safetensors",
    ]  # fmt: skip
    m = json.loads((step / "manifest.json").read_text())
    assert (m["format_version"], m["step"], m["world_size"], m["zero_stage"]) == (2, 4, 2, 2)
    assert set(m["files"]) == set(names) - {"manifest.json"}  # config.yaml is checksummed too
    modes = {(step / n).stat().st_mode & 0o777 for n in names if n != "manifest.json"}
    assert len(modes) == 1, modes  # one mode for every file (0666 less the umask)
    wte = next(p for p in m["params"] if "wte.weight" in p["names"])
    assert wte["shape"] == [256, 32] and "lm_head.weight" in wte["names"]
    assert sum(piece["length"] for piece in wte["pieces"]) == 256 * 32
    assert find_checkpoint("auto", saved) == step
    assert not list(saved.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest", "newer"])
def test_corruption_is_named(saved: Path, tmp_path: Path, damage: str) -> None:
    import shutil

    ckpt = tmp_path / "c"
    shutil.copytree(saved / "step_00000004", ckpt)
    shard = ckpt / "shard_00001.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        expect = "shard_00001.safetensors: truncated"
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        expect = "shard_00001.safetensors: checksum mismatch"
    elif damage == "delete":
        shard.unlink()
        expect = "shard_00001.safetensors: missing checkpoint file"
    elif damage == "manifest":
        (ckpt / "manifest.json").unlink()
        expect = "manifest.json: missing manifest"
    else:
        m = json.loads((ckpt / "manifest.json").read_text())
        m["format_version"] = 99
        (ckpt / "manifest.json").write_text(json.dumps(m))
        expect = "format version 99 is newer"
    with pytest.raises(UserError, match=expect.replace(".", r"\.")):
        read_manifest(ckpt)


def test_resume_keeps_per_parameter_adam_steps(tmp_path: Path) -> None:
    """An expert no token picked in some steps lags in Adam steps (torch skips it); a resume, at another world
    size too, must carry that lag (the manifest's skipped_steps) or its bias correction jumps ahead."""
    cfg = tiny_cfg(
        model={"name": "python:tests.patterns.models:moe_idle_expert", "d_model": 32, "vocab_size": 256},
        zero={"stage": 2, "param_persistence_threshold": 64},
        train={"max_steps": 12, "grad_accum": 1},
        checkpoint={"dir": str(tmp_path / "a"), "every_steps": 6, "keep_last": 5},
    )
    full = run_zoff(cfg, 2, tmp_path)[0]
    manifest = read_manifest(tmp_path / "a" / "step_00000006")
    lagging = {p["names"][0]: p["skipped_steps"] for p in manifest["params"] if p.get("skipped_steps")}
    assert any(".experts.3." in n for n in lagging), lagging
    again = {**cfg, "checkpoint": {**cfg["checkpoint"], "dir": str(tmp_path / "b")}}
    r = run_zoff(again, 2, tmp_path, str(tmp_path / "a" / "step_00000006"))[0]
    assert r["losses"] == full["losses"][6:], "resumed losses must be bit-identical"
    for name, p in full["params"].items():
        assert torch.equal(r["params"][name], p), name


def test_format_1_checkpoints_still_load(tmp_path: Path) -> None:
    """A checkpoint written before format 2 (no skipped_steps, no frozen shards) resumes bit for bit when
    every parameter got a gradient every step, as before."""
    full = run_zoff(_cfg(2, 6, 6, 3, tmp_path / "a"), 2, tmp_path)[0]
    step = tmp_path / "a" / "step_00000003"
    m = json.loads((step / "manifest.json").read_text())
    assert m["format_version"] == 2 and not any("skipped_steps" in p or "frozen" in p for p in m["params"])
    m["format_version"] = 1
    (step / "manifest.json").write_text(json.dumps(m))
    r = run_zoff(_cfg(2, 6, 6, 3, tmp_path / "b"), 2, tmp_path, str(step))[0]
    assert r["start"] == 3 and r["losses"] == full["losses"][3:]


def test_checkpoint_enabled_false_never_saves(tmp_path: Path) -> None:
    """A run whose disk has no room for a copy of its states (the beyond-memory demonstration) turns saving
    off: no checkpoint at the end, not even a temporary folder."""
    cfg = tiny_cfg(train={"max_steps": 3}, checkpoint={"dir": str(tmp_path / "ckpt"), "enabled": False})
    out = run_zoff(cfg, 1, tmp_path)[0]
    assert len(out["losses"]) == 3
    assert not (tmp_path / "ckpt").exists()
