"""scripts/gpu_bench.py without a GPU: --cpu-smoke runs its code path at tiny size (2 ranks over gloo, fp32,
zoff's policies and FSDP2) and writes the JSON its table renders from; --dry-run prints the GPU plan and its
time bound and runs nothing. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_bench.py"
VARIANTS = ("zero2", "zero2-offload", "zero2-offload+spec", "zero3-offload", "zero3-offload+spec",
            "zero3-offload+wait-all", "zero3-nvme", "zero3-nvme+spec", "fsdp2-offload")  # fmt: skip
ROW = ("status", "steps", "timed_steps", "step_s", "tok_s", "mfu", "gpu_busy", "optimizer_s", "pcie",
       "peak_gpu_bytes", "peak_rss_bytes", "losses")  # fmt: skip


def script() -> ModuleType:
    """scripts/gpu_bench.py as a module (it imports its sibling benchlib)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("_gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_the_cpu_smoke_runs_every_variant_and_renders_its_table(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    p = run("--cpu-smoke", "--json", str(out), "--nvme-dir", str(tmp_path / "nvme"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    for key in ("date", "commit", "machine", "command", "mode", "device", "world", "model", "variants"):
        assert key in data, key
    assert data["world"] == 2 and data["model"]["precision"] == "fp32" and "fp32" in data["mode"]
    rows = {r["name"]: r for r in data["variants"]}
    assert tuple(rows) == VARIANTS
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["status"])
        assert all(k in r for k in ROW), name
        assert r["steps"] >= 5 and len(r["losses"]) == r["steps"] and r["timed_steps"] >= 2
        assert r["tok_s"] > 0 and 0 < r["gpu_busy"] <= 1 and r["peak_rss_bytes"] > 0
        assert r["mfu"] is None and r["pcie"] is None and r["peak_gpu_bytes"] is None  # (no GPU here)
    assert set(rows["fsdp2-offload"]["clip"]) == {"ok"}  # clip_grad_norm_ runs on gloo
    assert sum(rows["zero3-offload+spec"]["spec_speculated_units"]) > 0
    # the same arithmetic: zoff's variants alike, FSDP2 within fp32's tolerance over every step
    lc = data["loss_check"]
    assert lc["ok"] is True and lc["steps"] >= 5 and lc["vs_fsdp2"] <= 1e-4 and lc["zoff_spread"] <= 1e-4
    table = p.stdout
    assert "| variant | steps | step, s | tok/s | MFU | GPU busy |" in table
    assert all(f"| {name} |" in table for name in VARIANTS)
    assert "zero3-offload / FSDP2 with CPU offload" in table and "CPU smoke (fp32" in table
    m = script()
    assert m.render(data).strip() in table  # the table is render()'s of the JSON written
    # where FSDP2's clip_grad_norm_ raises (on NCCL under CPU offload), the row and the loss check say so
    f = data["variants"][-1]
    f["clip"] = ["RuntimeError: no clip"] * f["steps"]
    data["loss_check"] = m.loss_check(data["variants"], "fp32")
    assert data["loss_check"]["steps"] == 1 and data["loss_check"]["fsdp2_clip"] == "RuntimeError: no clip"
    assert "trained unclipped" in m.render(data) and "compared at step 1 only" in m.render(data)


def test_the_dry_run_prints_the_gpu_plan_and_its_bound_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "never.json"
    p = run("--dry-run", "--json", str(out), "--nvme-dir", str(tmp_path / "absent"), timeout=60)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    assert "runs nothing" in text and "world 1 over nccl" in text
    assert "3.41B parameters, bf16, 8 x 2048 tokens" in text
    assert "time bound: 420 s for the whole call" in text
    assert all(f"  {name} " in text for name in VARIANTS)
    assert "CPUOffloadPolicy" in text and "cuda:nccl,cpu:gloo" in text
    assert "scripts/gpu_check.sh: " in text  # whether the session must run it first
    assert not out.exists() and not (tmp_path / "absent").exists()
