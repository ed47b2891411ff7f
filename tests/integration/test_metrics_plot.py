"""One `zoff train` run on Parquet documents with log.tensorboard: metrics.jsonl's per-step keys, the same
scalars in TensorBoard's event files, and `zoff plot` drawing exactly the run's curves."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.datafiles import DOCS, write_parquet
from zoff.models import flops_per_token
from zoff.trainer.metrics import MetricsWriter, peak_flops

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def zoff(*args: str, cwd: Path = REPO, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "zoff", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("metrics")
    data = write_parquet(tmp / "docs.parquet", DOCS * 20)
    run_dir = tmp / "run"
    p = zoff(
        "train", str(REPO / "configs" / "tiny.yaml"), "--run-dir", str(run_dir),
        "data.name=parquet", f"data.paths=[{data}]", f"data.cache_dir={tmp / 'cache'}",
        "log.tensorboard=true", "log.progress=false", f"train.max_steps={STEPS}", "train.log_every=2",
        "train.eval_every=3", "launch.threads_per_rank=1",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return run_dir


def test_every_logged_step_has_the_per_step_keys(run):
    steps = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 4, 6]  # step 1, every log_every, and the last
    for r in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_rss_mib"} <= set(r)
        assert 50 < r["peak_rss_mib"] < 8192
        assert "mfu" not in r and "peak_alloc_mib" not in r  # a CPU: no known peak, no CUDA allocator
    assert [r["step"] for r in records(run) if "val_loss" in r] == [3, 6]


def test_tensorboard_holds_the_same_scalars_as_metrics_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    want: dict[str, list[tuple[int, float]]] = {}
    for r in records(run):
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)):
                want.setdefault(k, []).append((r["step"], float(v)))
    assert set(acc.Tags()["scalars"]) == set(want)
    for tag, series in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in series], tag
        for (_, a), (_, b) in zip(got, series):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-12), tag  # event files store float32


def test_zoff_plot_draws_the_runs_curves(run, tmp_path):
    out = tmp_path / "curves.png"
    p = zoff("plot", str(run), "--out", str(out))
    assert p.returncode == 0, p.stderr
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    from zoff.trainer.plot import plot_runs

    drawn = plot_runs([run, run], tmp_path / "two.png")  # the same run twice: two labelled copies
    assert len(drawn) == 2
    recs = records(run)
    for series in drawn.values():
        for key in ("loss", "val_loss", "tokens_per_s", "peak_rss_mib"):  # memory beside the loss
            steps, values = series.curves[key]
            assert steps == [r["step"] for r in recs if key in r]
            assert values == [r[key] for r in recs if key in r]


def test_plot_errors_are_one_line(tmp_path):
    p = zoff("plot", str(tmp_path))
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"zoff: error: {tmp_path}: no metrics.jsonl (not a zoff run directory, or no step logged yet)"
    ]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 1.0}\n')
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    p = zoff("plot", str(tmp_path), env_extra={"PYTHONPATH": str(fake)})
    assert p.returncode == 2
    assert p.stderr.strip() == "zoff: error: zoff plot: needs matplotlib: pip install zoff[plot]"


def test_mfu_where_the_peak_is_known(tmp_path):
    assert peak_flops(torch.device("cpu"), "bf16") is None
    assert flops_per_token(1000, 2, 16, 32) == 6 * 1000 + 12 * 2 * 16 * 32
    log = logging.getLogger("test-mfu")
    w = MetricsWriter(tmp_path, 1, 0, False, log, tensorboard=False, flops_per_token=6e6)
    w.peak_flops = 1e12  # as for a GPU in the table
    w.step(
        {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 5e4, "step_time_s": 0.1}, True
    )
    assert records(tmp_path)[0]["mfu"] == pytest.approx(6e6 * 5e4 / 1e12)
