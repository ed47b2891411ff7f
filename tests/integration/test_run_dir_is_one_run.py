"""A run directory is one run (issue 68, item 1). At 51a0203 this sequence lost data: a second, fresh run of
another model into the first run's directory truncated its metrics.jsonl (11 lines to 4), retention deleted
the new run's step-3 checkpoint (it kept the old run's 5 and 10), `latest` named the deleted one, and
`--resume auto` then picked the old run's step 10 and failed inside the ranks with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "zoff", "train", TINY, *args], capture_output=True, text=True, timeout=300,
        cwd=cwd, env=env,
    )  # fmt: skip


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


FIRST = ["train.max_steps=10", "checkpoint.every_steps=5"]
SECOND = ["train.max_steps=3", "checkpoint.every_steps=3", "model.d_model=64"]


def test_a_fresh_run_into_another_runs_directory_refuses_and_touches_nothing(tmp_path) -> None:
    first = _train(*FIRST, "--run-dir", "R", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _tree(tmp_path / "R")
    second = _train(*SECOND, "--run-dir", "R", cwd=tmp_path)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        "zoff: error: --run-dir: R holds another run (metrics.jsonl (11 records), checkpoints up to step 10 in "
        "R/checkpoints); continue it with --resume auto, start over with --fresh (moves it aside, deletes "
        "nothing), or choose another --run-dir"
    ]
    assert _tree(tmp_path / "R") == before
    other = _train(*SECOND, "--run-dir", "R", "--resume", "auto", cwd=tmp_path)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert other.stderr.strip().splitlines()[-1] == (
        "zoff: error: --resume: R/checkpoints/step_00000010 holds another model (wte.weight is [256, 32] there, "
        "[256, 64] in this config); resume it with its own config, or start over with --fresh or another --run-dir"
    )
    assert _tree(tmp_path / "R") == before


def test_fresh_moves_the_earlier_run_aside_and_starts_over(tmp_path) -> None:
    assert _train(*FIRST, "--run-dir", "R", cwd=tmp_path).returncode == 0
    before = _tree(tmp_path / "R")
    again = _train(*SECOND, "--run-dir", "R", "--fresh", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("R.old-")]
    assert len(aside) == 1 and _tree(aside[0]) == before  # nothing of the old run lost
    assert f"zoff: --fresh: moved the earlier run aside: {aside[0].name}" in again.stdout
    ckpts = tmp_path / "R" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003"]
    assert (ckpts / "latest").read_text().strip() == "step_00000003"
    assert len((tmp_path / "R" / "metrics.jsonl").read_text().splitlines()) >= 3
    both = _train(*SECOND, "--run-dir", "R", "--fresh", "--resume", "auto", cwd=tmp_path)
    assert both.returncode == 2 and both.stderr.strip().splitlines() == [
        "zoff: error: --fresh: starts over; it cannot be combined with --resume"
    ]


def test_resume_auto_without_a_run_dir_continues_the_configs_newest_run(tmp_path) -> None:
    none = _train("--resume", "auto", cwd=tmp_path)
    assert none.returncode == 2 and none.stderr.strip().splitlines() == [
        "zoff: error: --resume auto: no run of tiny.yaml under runs/ holds a checkpoint; give its --run-dir"
    ]
    first = _train("train.max_steps=4", "checkpoint.every_steps=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    later = _train("train.max_steps=6", "checkpoint.every_steps=2", "--resume", "auto", cwd=tmp_path)
    assert later.returncode == 0, later.stderr[-3000:]
    assert f"zoff: --resume auto: continuing runs/{run.name} (the newest run of tiny.yaml under runs/)" in (
        later.stdout
    )
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1] == "step_00000006"


def test_retention_never_deletes_the_checkpoint_just_saved(tmp_path) -> None:
    """A run resumed from an earlier checkpoint saves beside higher steps: at 51a0203 retention kept the
    highest step numbers and deleted the new save, leaving `latest` naming nothing."""
    assert _train(*FIRST, "--run-dir", "R", cwd=tmp_path).returncode == 0
    ckpts = tmp_path / "R" / "checkpoints"
    again = _train(
        "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=1", "--run-dir", "R",
        "--resume", str(ckpts / "step_00000005"), cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000006"]
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
