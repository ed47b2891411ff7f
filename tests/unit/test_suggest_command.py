"""`zoff estimate --suggest` ends with the exact `zoff train` line for its row, and `--write FILE` writes that
config (issue 68, item 2): at 51a0203 it named a policy (`zero3-offload-opt`) that `zero=` refused, and nothing
to run. The line, typed back, loads a config whose policy, activation checkpointing and GPUs per node are the
suggested row's."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from zoff.config import load_config
from zoff.engine.policy import Policy

REPO = Path(__file__).resolve().parents[2]
CASES = [
    ("configs/gpt-70b.yaml", "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--cpu-memory", "2TiB"),
    (
        "configs/gpt-3b-nvme.yaml",
        "--gpus-per-node",
        "1",
        "--gpu-memory",
        "24GiB",
        "--cpu-memory",
        "24GiB",
        "--disk",
        "1TB",
    ),  # fmt: skip
    (
        "configs/gpt-7b.yaml",
        "train.activation_checkpointing=false",
        "--gpus-per-node",
        "2",
        "--gpu-memory",
        "24GiB",
        "--cpu-memory",
        "512GiB",
    ),  # fmt: skip
]


def _estimate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zoff", "estimate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def _typed_back(line: str) -> tuple[Policy, int]:
    argv = shlex.split(line)
    assert argv[:2] == ["zoff", "train"], line
    flags = {argv[i]: argv[i + 1] for i in range(len(argv)) if argv[i].startswith("--")}
    plain = [
        a for i, a in enumerate(argv[2:], 2) if not a.startswith("--") and not argv[i - 1].startswith("--")
    ]
    cfg = load_config(REPO / plain[0], plain[1:])
    gpus = int(flags.get("--nproc-per-node", cfg.launch.nproc_per_node))
    return Policy.of(cfg.zero, cfg.train.activation_checkpointing), gpus


@pytest.mark.parametrize("case", CASES, ids=lambda c: Path(c[0]).stem)
def test_the_suggested_line_trains_the_suggested_row(case: tuple[str, ...]) -> None:
    out = _estimate(*case, "--suggest", "--json")
    assert out.returncode == 0, out.stderr
    sug = json.loads(out.stdout)["suggestion"]
    want = Policy(
        sug["stage"], sug["offload_optimizer"], sug["offload_param"], sug["activation_checkpointing"]
    )
    assert _typed_back(sug["command"]) == (want, int(case[case.index("--gpus-per-node") + 1]))
    text = _estimate(*case, "--suggest")
    assert text.stdout.rstrip().splitlines()[-1] == f"run: {sug['command']}"


def test_write_puts_the_suggested_config_in_a_new_file(tmp_path) -> None:
    target = tmp_path / "70b.yaml"
    out = _estimate(*CASES[0], "--suggest", "--write", str(target))
    assert out.returncode == 0, out.stderr
    line = out.stdout.rstrip().splitlines()[-1].removeprefix("run: ")
    assert line == f"zoff train {target}"  # (the file holds the GPUs per node too)
    sug = json.loads(_estimate(*CASES[0], "--suggest", "--json").stdout)["suggestion"]
    assert _typed_back(line) == _typed_back(sug["command"])
    assert target.read_text().startswith("# zoff estimate --suggest's row for configs/gpt-70b.yaml\n")
    before = target.read_text()
    again = _estimate(*CASES[0], "--suggest", "--write", str(target))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"zoff: error: --write: {target} already exists (choose another file)"
    ]
    assert target.read_text() == before
    alone = _estimate(CASES[0][0], "--write", str(tmp_path / "x.yaml"))
    assert alone.returncode == 2 and "add --suggest" in alone.stderr and not (tmp_path / "x.yaml").exists()


def test_a_disk_tier_folder_not_made_yet_offers_the_free_space_where_it_will_be(tmp_path) -> None:
    """At 51a0203 `--suggest` on configs/gpt-3b-nvme.yaml said "no disk tier" and "use more GPUs" when its
    nvme_path did not exist yet; the engine makes the folder, so its parent's free space is the tier."""
    later = tmp_path / "not" / "yet"
    args = ("configs/gpt-3b-nvme.yaml", f"zero.offload_optimizer.nvme_path={later}", "--gpus-per-node", "1",
            "--gpu-memory", "24GiB", "--cpu-memory", "24GiB")  # fmt: skip
    out = _estimate(*args, "--suggest", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["memory"]["disk_bytes"] > 0 and got["suggestion"]["offload_optimizer"] == "nvme", got["suggestion"]
    assert not later.exists()  # (the estimate makes nothing)
