"""scripts/bench_beyond_memory.py end to end at its tiny size: the builtin GPT and an hf: model, stage 3 with
parameters and optimizer states on disk, a few steps; the JSON has the table's fields and a finite loss."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from zoff.config import CONFIGS_DIR
from zoff.engine.disk.swapfile import filesystem_type

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_beyond_memory.py"
FIELDS = (
    "params", "model_state_bytes", "model_state_to_ram", "peak_rss_per_rank_bytes", "peak_rss_launcher_bytes",
    "peak_rss_job_bytes", "page_cache_growth_bytes", "disk_io_per_step", "bench_io", "step_time_split",
    "steps", "vs_estimate", "estimate", "missing_from_trainer",
)  # fmt: skip


@pytest.fixture
def disk_dir(tmp_path):
    """tmp_path when it is on a real disk (O_DIRECT), else a folder under /var/tmp."""
    if filesystem_type(tmp_path) not in ("tmpfs", "ramfs"):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="zoff-bbm-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_bench(disk: Path, *args: str) -> dict:
    out = disk / "out.json"
    cmd = [sys.executable, str(SCRIPT), "--size", "tiny", "--steps", "3", "--path", str(disk / "swap"),
           "--io-size", "16MiB", "--interval", "0.1", "--nproc", "2", "--json", str(out), "--run-dir", str(disk / "run"), *args]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "zoff beyond memory" in p.stdout  # the table
    return json.loads(out.read_text())


def check(r: dict) -> None:
    assert r["status"] == "ok"
    for key in FIELDS:
        assert key in r, key
    assert r["model_state_bytes"] == 16 * r["trainable_params"]
    assert sorted(r["peak_rss_per_rank_bytes"]) == ["rank0", "rank1"]
    assert all(v > 0 for v in r["peak_rss_per_rank_bytes"].values())
    assert r["peak_rss_job_bytes"] >= sum(r["peak_rss_per_rank_bytes"].values()) // 2
    losses = [s["loss"] for s in r["steps"]]
    assert [s["step"] for s in r["steps"]] == [1, 2, 3]
    assert all(math.isfinite(x) for x in losses)
    # the swap files are what the estimate planned, to the byte (sampled while they existed)
    assert r["vs_estimate"]["disk_bytes"]["measured"] == r["estimate"]["disk_bytes"] > 0
    assert r["bench_io"]["raw_read_gbps"] > 0 and r["bench_io"]["raw_write_gbps"] > 0
    assert set(r["nvme_sections"]) == {"offload_optimizer", "offload_param"}
    split = r["step_time_split"]  # from the engine's timings and swap-file waits in metrics.jsonl
    assert split["steps"] == [2, 3] and split["compute_s"] > 0 and split["param_read_wait_s"] >= 0


@pytest.mark.grid  # the default suite's time budget (26 s): a benchmark script, not the product
def test_bench_beyond_memory_tiny_gpt(disk_dir):
    r = run_bench(disk_dir)
    check(r)
    assert r["estimate"]["policy"] == "zero3-nvme"
    assert not list((disk_dir / "swap").rglob("*.swap")), "swap files left behind"
    # the floor, measured in the same job, and zoff estimate --time's prediction beside the step
    assert "floor_error" not in r, r.get("floor_error")
    c = r["floor"]["compute"]  # two depths, alternating over rounds: every steady step of each kept
    assert c["depths"] == [2, 6] and c["rounds"] == 2 and r["floor"]["floor_s"] > 0
    assert c["rounds_before_run"] == 1  # the floor brackets the run: one round before it, one after
    assert [len(c["samples_s"][d]) for d in ("2", "6")] == [2 * 4, 2 * 4]  # 5 steps a run, the first dropped
    assert r["floor"]["step_to_floor"] == r["step_time_median_s"] / r["floor"]["floor_s"]
    assert r["prediction"]["step_s"] == r["prediction"]["forward_backward_s"] + r["prediction"]["optimizer_s"]


@pytest.mark.grid  # the default suite's time budget: the GPT case runs the same script there
def test_bench_beyond_memory_tiny_hf_model(disk_dir):
    pytest.importorskip("transformers")
    r = run_bench(
        disk_dir, "--config", str(CONFIGS_DIR / "llama-tiny.yaml"), "zero.stage=3",
        "zero.offload_optimizer.device=nvme", "zero.offload_optimizer.host_budget=min", "zero.offload_param.device=nvme", "data.batch_size=2",
    )  # fmt: skip
    check(r)
    assert r["config"].endswith("llama-tiny.yaml")


@pytest.mark.grid  # the default suite's time budget: a benchmark script, not the product
def test_bench_beyond_memory_tiny_preset(disk_dir):
    """--preset dpu-2g: the preset's overrides go after the command line's, and the command it records names
    the preset (the JSON it would write by default is its own, docs/results/bench_beyond_memory_dpu_2g.json)."""
    r = run_bench(disk_dir, "--preset", "dpu-2g", "--floor-depths", "")
    assert r["status"] == "ok"
    preset = ["zero.offload_optimizer.overlap_step=false", "zero.offload_optimizer.delay_update=true",
              "zero.offload_optimizer.host_budget=2GiB"]  # fmt: skip
    assert r["overrides"][-5:-2] == preset  # (--path's two nvme_path overrides come last)
    assert "--preset dpu-2g" in r["command"] and "--json" not in r["command"]
    assert [s["step"] for s in r["steps"]] == [1, 2, 3]
    assert all(math.isfinite(s["loss"]) for s in r["steps"])
    assert "dpu_wait_s" in r["step_time_split"]  # the delayed update's split: the preset reached the run
    assert r["vs_estimate"]["disk_bytes"]["measured"] == r["estimate"]["disk_bytes"] > 0
