"""A 16-bit precision on a CPU without fast kernels for it (issue 52): the plan, `zoff doctor` and
`zoff estimate --time` say so with the measured factor, and `train.cpu_precision` computes in fp32 there.

The host kind is forced both ways through ZOFF_MATMUL_FACTOR (zoff.host.kernels), so these tests show the same
thing on a host with bf16 kernels (AVX512) and on one without (AVX2 only, where bf16 is ~100x slower)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.forked_zoff import zoff_run
from tests.harness import assert_close_losses, assert_close_params, reference_run, run_zoff
from zoff.config import config_from_dict
from zoff.host import kernels

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
SLOW, FAST = "bf16:137,fp16:90", "bf16:1,fp16:1"


def zoff(*args: str, factor: str, timeout: float = 240, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m zoff ARGS` with the matmul factor forced, forked unless `fresh` (tests.forked_zoff)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env[kernels.FACTOR_ENV] = factor
    return zoff_run(list(args), cwd=REPO, env=env, timeout=timeout, fresh=fresh)


@pytest.fixture
def forced(monkeypatch):
    """Set ZOFF_MATMUL_FACTOR in this process; matmul_path's per-process cache is cleared around it."""

    def force(value: str) -> None:
        monkeypatch.setenv(kernels.FACTOR_ENV, value)
        kernels.matmul_path.cache_clear()

    yield force
    kernels.matmul_path.cache_clear()


def test_the_forced_factor_decides_the_verdict_and_the_plan_line(forced):
    forced(SLOW)
    assert kernels.slow_dtype("bf16").factor == 137 and kernels.slow_dtype("fp16").factor == 90
    precision, line = kernels.compute_precision("bf16", "native", on_cpu=True)
    assert precision == "bf16"
    assert "WARNING: bf16 matmul on the CPU: reference kernel" in line and "137x fp32's time" in line
    assert "train.cpu_precision=auto computes in fp32" in line
    assert kernels.compute_precision("bf16", "auto", on_cpu=True)[0] == "fp32"
    assert kernels.compute_precision("bf16", "auto", on_cpu=False) == ("bf16", None)  # a GPU rank
    assert kernels.compute_precision("fp32", "auto", on_cpu=True) == ("fp32", None)
    forced(FAST)
    assert kernels.slow_dtype("bf16") is None
    assert kernels.compute_precision("bf16", "native", on_cpu=True) == ("bf16", None)
    assert kernels.compute_precision("bf16", "auto", on_cpu=True) == ("bf16", None)
    assert kernels.compute_precision("bf16", "fp32", on_cpu=True)[0] == "fp32"  # fp32 whatever the host


def test_a_malformed_factor_names_the_variable(forced):
    forced("bf16:fast")
    with pytest.raises(ValueError, match="ZOFF_MATMUL_FACTOR: 'bf16:fast' is not DTYPE:FACTOR"):
        kernels.matmul_path(torch.bfloat16)


def test_the_probe_measures_this_host():
    """Unforced, the probe gives a factor and a verdict that agree (whatever this host is)."""
    kernels.matmul_path.cache_clear()
    path = kernels.matmul_path(torch.bfloat16)
    assert path.source == "probe" and path.factor > 0 and path.slow == (path.factor >= kernels.SLOW_FACTOR)
    assert kernels.matmul_path(torch.float32).factor == 1.0


@pytest.mark.parametrize("factor,slow", [(SLOW, True), (FAST, False)])
def test_doctor_reports_the_matmul_path_per_dtype(factor, slow):
    p = zoff("doctor", factor=factor, fresh=slow)  # (one call in a new interpreter)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)["cpu_matmul"]
    assert report["fp32"]["slow"] is False
    assert report["bf16"]["slow"] is slow and report["fp16"]["slow"] is slow
    assert report["bf16"]["x_fp32_time"] == (137.0 if slow else 1.0)
    assert report["bf16"]["source"] == "ZOFF_MATMUL_FACTOR"


def _train(tmp_path: Path, factor: str, *overrides: str) -> subprocess.CompletedProcess:
    run = tmp_path / "run"
    return zoff(
        "train", str(TINY), "--run-dir", str(run), "--nproc-per-node", "1",
        "train.max_steps=1", "train.precision=bf16", "train.eval_batches=1", *overrides, factor=factor,
    )  # fmt: skip


@pytest.mark.slow
def test_the_plan_warns_on_a_slow_host_and_auto_computes_in_fp32(tmp_path):
    native = _train(tmp_path / "native", SLOW)
    assert native.returncode == 0, native.stderr
    assert "torch.bfloat16 compute" in native.stdout
    assert "WARNING: bf16 matmul on the CPU: reference kernel" in native.stdout and "137x" in native.stdout
    auto = _train(tmp_path / "auto", SLOW, "train.cpu_precision=auto")
    assert auto.returncode == 0, auto.stderr
    assert "torch.float32 compute" in auto.stdout
    assert "train.cpu_precision=auto: computing in fp32, not bf16" in auto.stdout
    upcast = _train(tmp_path / "upcast", SLOW, "train.cpu_precision=upcast")
    assert upcast.returncode == 0, upcast.stderr
    assert "torch.bfloat16 states, torch.float32 compute" in upcast.stdout
    assert "train.cpu_precision=upcast: computing in fp32 on the CPU over bf16 storage" in upcast.stdout
    fast = _train(tmp_path / "fast", FAST, "train.cpu_precision=auto")
    assert fast.returncode == 0, fast.stderr
    assert "torch.bfloat16 compute" in fast.stdout and "cpu_precision" not in fast.stdout


def _cfg(precision: str, cpu_precision: str) -> dict:
    return {
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
        "data": {"name": "synthetic", "seq_len": 16, "batch_size": 2, "synthetic_tokens": 4000},
        "zero": "zero3-offload",
        "optim": {"lr": 3e-3},
        "train": {"max_steps": 4, "precision": precision, "cpu_precision": cpu_precision, "grad_clip": 1.0},
    }


def test_cpu_precision_fp32_trains_as_the_fp32_config_and_plain_pytorch():
    """bf16 with cpu_precision=fp32 on a CPU rank: the fp32 run's bits (the same engine, fp32 everywhere), and
    plain PyTorch's fp32 AdamW within 1e-5. (A GPU rank would compute in bf16: the key is the CPU's.)"""
    got = run_zoff(_cfg("bf16", "fp32"), 2)[0]
    fp32 = run_zoff(_cfg("fp32", "native"), 2)[0]
    assert got["losses"] == fp32["losses"]
    for name, value in fp32["params"].items():
        assert torch.equal(got["params"][name], value), name
        assert got["params"][name].dtype == torch.float32
    want = reference_run(config_from_dict(_cfg("fp32", "native")), 2)
    assert_close_losses(got["losses"], want["losses"])
    assert_close_params(got["params"], want["params"])


@pytest.mark.parametrize("cpu_precision", ["native", "auto", "upcast"])
def test_estimate_time_probes_in_fp32_and_scales_by_the_factor_only_where_bf16_runs(
    forced, monkeypatch, cpu_precision
):
    """`zoff estimate --time` on a slow host: bf16's own probe would take minutes a layer, so it probes in fp32;
    a run that computes in bf16 (native) takes the factor longer, one that computes in fp32 (auto) does not."""
    from zoff.config import DataConfig, ModelConfig, TrainConfig, ZeroConfig
    from zoff.planning import step_time

    probed = []

    def probe(model_cfg, data_cfg, train_cfg, zero, local_ranks):
        probed.append(train_cfg.precision)
        return 2.0, 1e-9

    monkeypatch.setattr(step_time, "probe_engine", probe)
    forced(SLOW)
    train = TrainConfig(precision="bf16", cpu_precision=cpu_precision)
    compute_s, _, source = step_time._probe_compute(ModelConfig(), DataConfig(), train, ZeroConfig(), 1)
    if cpu_precision == "upcast":  # probed as it runs: bf16 states, upcast to fp32 compute; no factor
        assert probed == ["bf16"] and compute_s == 2.0
        assert "train.cpu_precision=upcast: bf16 runs in fp32 over bf16 states on this CPU" in source
        return
    assert probed == ["fp32"]
    if cpu_precision == "native":
        assert compute_s == 2.0 * 137 and "in fp32 x 137 (bf16 matmul on the CPU: reference kernel" in source
    else:
        assert compute_s == 2.0 and "train.cpu_precision=auto: bf16 runs in fp32 on this CPU" in source
    forced(FAST)
    probed.clear()
    compute_s, _, source = step_time._probe_compute(ModelConfig(), DataConfig(), train, ZeroConfig(), 1)
    assert probed == ["bf16"] and compute_s == 2.0 and source.endswith("in bf16")


def test_the_estimate_counts_the_precision_a_cpu_rank_computes_in(forced):
    """On a CPU-only host the estimate follows train.cpu_precision as the trainer does (the bytes the engine
    allocates); a GPU's estimate stays as configured."""
    from zoff.config import DataConfig, ModelConfig, TrainConfig, ZeroConfig
    from zoff.planning.memory import estimate

    model, data = ModelConfig(n_layer=2, n_head=2, d_model=64), DataConfig(seq_len=32, batch_size=2)

    def rows(precision: str, cpu_precision: str, device_type: str = "cpu") -> list:
        train = TrainConfig(precision=precision, cpu_precision=cpu_precision)
        est = estimate(model, data, train, ZeroConfig(), 2, device_type=device_type, host_bytes=8 << 30)
        return [(p.gpu, p.cpu, p.disk) for p in est.policies], est.precision

    forced(SLOW)
    fp32, bf16 = rows("fp32", "native"), rows("bf16", "native")
    assert fp32 != bf16
    assert rows("bf16", "auto") == fp32 and rows("bf16", "fp32") == fp32
    assert rows("bf16", "auto", "cuda") == rows("bf16", "native", "cuda")
    # upcast: bf16's states under fp32 activations (the engine's allocations; activations are in the GPU
    # column of a CPU-only host's rows)
    upcast = rows("bf16", "upcast")
    assert upcast[1] == "bf16" and upcast[0] not in (fp32[0], bf16[0])
    assert [row[2] for row in upcast[0]] == [row[2] for row in bf16[0]]  # the disk's bytes are bf16's
    forced(FAST)
    assert rows("bf16", "auto") == bf16 and rows("bf16", "fp32") == fp32
    assert rows("bf16", "upcast") == upcast  # (no probe: the same on every host)
