"""scripts/gpu_check.sh where there is no GPU: --dry-run shows every step, a real run refuses in one line.

The script's GPU run itself is checked on a GPU machine (it is the check); these tests keep its CPU-side
promises: a dry run that works anywhere, no traceback and nothing written where CUDA is missing, usage errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def gpu_check(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # The venv's interpreter, whatever `python` is on PATH; from another cwd, since the script finds the repo.
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_script_is_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)


def test_dry_run_prints_every_step_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gc"
    r = gpu_check("--dry-run", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "-m cuda tests/gpu" in text
    assert "ZOFF_TEST_DEVICE=cuda" in text and "tests/patterns/test_zoo.py -k test_slice" in text
    assert "tests/integration/test_engine_equivalence.py" in text
    for recipe in ("zero0", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload"):
        assert f"zoff train configs/quickstart.yaml zero={recipe} " in text
    assert "bench_adam.py --sizes 16M,64M --rounds 5" in text
    assert str(out / "bench_adam.json") in text  # --out resolved against the caller's cwd
    assert "torch " + torch.__version__ in text
    if not torch.cuda.is_available():
        assert "no CUDA device here: this is what a 1-GPU machine would run" in text
        assert "world size: 1" in text and "ZOFF_TEST_WORLD=1" in text
        assert "launch.nproc_per_node=1" in text
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gc"
    r = gpu_check("--out", str(out), cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), r.stderr
    assert "--dry-run" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert not out.exists()


@pytest.mark.parametrize("args", [["--bogus"], ["--out"], ["extra"]])
def test_bad_arguments_are_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    r = gpu_check(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and "usage: scripts/gpu_check.sh" in r.stderr
    assert "Traceback" not in r.stderr
