"""scripts/bench_cpu_precision.py (issue 52): the demo with train.cpu_precision=auto against its fp32 config,
interleaved, the per-round ratio's median against 1.5x, the factor and the predicted native step. Synthetic runs
only: no benchmark runs here (a dry run prints the runs it would start)."""

from __future__ import annotations

import copy
import json

import pytest

from tests.unit.test_bench_tables import _script

bench = _script("bench_cpu_precision")

PLAN_FP32 = [
    "zoff: run directory /tmp/x/run",
    "zoff plan: world size 1 (gloo), ZeRO stage 3, torch.float32 compute, 2 thread(s) per rank",
    "  params 453,000,000 trainable in 6 unit(s); this rank's shard 453,000,000 elements",
    "  train.cpu_precision=auto: computing in fp32, not bf16: bf16 matmul on the CPU: reference kernel (...)",
    "step      1  loss 5.5628  lr 1.50e-03",
]


OPS = {
    "forward x @ W.T": {"bf16_s": 0.4, "fp32_s": 0.035},
    "input grad g @ W": {"bf16_s": 14.2, "fp32_s": 0.03},
    "weight grad g.T @ x": {"bf16_s": 0.4, "fp32_s": 0.035},
}


def _run(rnd: int, variant: str, step: float, loss: float = 5.5, other: float = 0.05) -> dict:
    return {
        "round": rnd, "variant": variant, "plan": [], "computed": "fp32",
        "step_s": [3 * step, step, step * 1.02, step * 0.98], "compute_s": [2.0, 0.6 * step, 0.6 * step, 0.6 * step],
        "loss": [loss, loss - 0.1, loss - 0.2, loss - 0.3], "loadavg_before": 0.5, "wall_s": 60.0, "other_cores": other,
    }  # fmt: skip


def _data(
    fix: tuple[float, ...], fp32: tuple[float, ...], loss_fix: float = 5.5, busy: tuple[int, ...] = ()
) -> dict:
    """Rounds of both variants at these step times; the rounds in `busy` shared the cores with other work."""
    runs = []
    for k, (a, b) in enumerate(zip(fix, fp32)):
        other = 0.96 if k in busy else 0.05
        pair = {
            bench.FIX: _run(k, bench.FIX, a, loss_fix, other),
            bench.FP32: _run(k, bench.FP32, b, other=other),
        }
        runs += [pair[v] for v in bench.round_order(k)]
    factor = {
        "probe": {"factor": 137.0, "kernel": False, "source": "probe", "describe": "bf16 matmul on the CPU: x"},
        "demo_matmul": {"shape": [256, 3072, 3072], "threads": 2, "ops": OPS, "bf16_s": 15.0, "fp32_s": 0.1,
                        "factor": 150.0},
    }  # fmt: skip
    return {
        "date": "2026-12-01T10:00:00+00:00", "commit": "abc1234",
        "machine": {"cpu": "AMD EPYC 7B13", "cores": 2, "ram_bytes": 24 * 2**30, "os": "Linux", "torch": "2.13.0"},
        "command": "python scripts/bench_cpu_precision.py", "runs": runs, "factor": factor,
        "host": {"avx512": False, "flags": ["avx", "avx2"], "bf16_kernel": False, "cpu_capability": "AVX2"},
        "summary": bench.summarise(runs, factor["demo_matmul"], layers=4, quiet_max=0.25),
    }  # fmt: skip


def test_the_ratio_is_the_median_of_per_round_ratios_and_meets_the_target() -> None:
    data = _data(fix=(10.2, 10.8), fp32=(10.0, 10.0))
    s = data["summary"]
    assert s["ratios"] == pytest.approx([1.02, 1.08])
    assert s["ratio"] == pytest.approx(1.05) and s["result"] == "PASS" and s["target"] == 1.5
    assert s["variants"][bench.FP32]["step_s"] == pytest.approx(10.0)  # the warm-up step (3x) left out
    assert s["loss_max_diff"] == 0.0
    # the fp32 step, each of 4 blocks' 12 d x d layers at bf16's time less fp32's
    assert s["predicted_native_step_s"] == pytest.approx(10.0 + 4 * 12 * (15.0 - 0.1))

    table = bench.render(copy.deepcopy(data))
    assert "| variant | computed in | step s (median) | ratio to fp32 | target |" in table
    assert f"| {bench.FIX} | fp32 | 10.50 | 1.05x | <= 1.5x: PASS |" in table
    assert f"| {bench.FP32} | fp32 | 10.00 | 1.00x |  |" in table
    assert (
        "1.020, 1.080 (median 1.050; 2 round(s), each quiet (other processes < 0.25 cores busy))" in table
        and "losses of the two variants equal" in table
    )
    assert "without AVX512" in table and "oneDNN bf16 kernel: False" in table and "AVX2" in table
    assert "3072x3072 linear layer on 256 tokens at 2 threads" in table
    assert "input grad g @ W 14.20 s / 0.030 s" in table and "together 150x" in table
    assert "Predicted, not run: the native bf16 step 725 s" in table
    assert table.rstrip("\n").splitlines()[-1].startswith("Measured 2026-12-01 10:00 UTC at commit abc1234")


def test_a_ratio_above_the_target_misses_and_differing_losses_are_named() -> None:
    data = _data(fix=(20.0, 16.0), fp32=(10.0, 10.0), loss_fix=5.6)
    assert data["summary"]["ratio"] == pytest.approx(1.8) and data["summary"]["result"] == "MISS"
    table = bench.render(data)
    assert "| 1.80x | <= 1.5x: MISS |" in table
    assert "max difference 1.00e-01" in table


def test_the_plan_says_what_the_run_computed_in() -> None:
    lines = bench.plan_lines(PLAN_FP32)
    assert [ln.split(":")[0] for ln in lines] == ["zoff plan", "train.cpu_precision=auto"]
    assert bench.computed(lines) == "fp32"
    assert bench.computed(["zoff plan: world size 1 (gloo), ZeRO stage 3, torch.bfloat16 compute"]) == "bf16"
    assert bench.computed([]) == "?"


def test_a_round_that_shared_the_cores_is_left_out() -> None:
    data = _data(fix=(10.2, 25.0, 10.8), fp32=(10.0, 10.0, 10.0), busy=(1,))
    s = data["summary"]
    assert s["rounds_used"] == [0, 2] and s["quiet_rounds"] == 2 and s["ratio"] == pytest.approx(1.05)
    assert "the 2 quiet round(s) of 3 (other processes < 0.25 cores busy)" in bench.render(data)

    noisy = _data(fix=(10.2, 25.0), fp32=(10.0, 10.0), busy=(0, 1))
    assert noisy["summary"]["rounds_used"] == [0, 1] and noisy["summary"]["ratio"] == pytest.approx(1.76)
    assert "every one of 2 round(s), none quiet" in bench.render(noisy)


def test_rounds_run_until_enough_were_quiet(monkeypatch) -> None:
    busy = iter([0.9, 0.1, 0.1, 0.1, 0.1, 0.1] + [0.9] * 12)
    monkeypatch.setattr(bench, "run_once", lambda config, a, rnd, v: _run(rnd, v, 10.0, other=next(busy)))
    args = bench.parse(["--rounds", "2"])[1]
    assert [r["round"] for r in bench.measure_runs(args)] == [0, 0, 1, 1, 2, 2]  # round 0 was busy
    assert len(bench.measure_runs(args)) == 2 * 6  # never quiet: 3x --rounds, then it stops


def test_the_variants_alternate_round_by_round() -> None:
    assert [bench.round_order(k) for k in range(3)] == [
        [bench.FIX, bench.FP32], [bench.FP32, bench.FIX], [bench.FIX, bench.FP32],
    ]  # fmt: skip
    fix, fp32 = (bench.overrides(4, 4, v) for v in (bench.FIX, bench.FP32))
    assert "zero=zero3-offload" in fix and "model.n_layer=4" in fix and "train.max_steps=4" in fix
    assert fix[-1] == "train.cpu_precision=auto" and fp32[-1] == "train.precision=fp32"


def test_a_dry_run_starts_nothing(monkeypatch, capsys) -> None:
    def no_run(*a, **k):
        raise AssertionError("a dry run started a run")

    monkeypatch.setattr(bench.benchlib, "train_records", no_run)
    monkeypatch.setattr(bench, "measure_factor", no_run)
    assert bench.main(["--dry-run", "--rounds", "1", "--layers", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("configs/gpt-3b-nvme.yaml" in ln and "model.n_layer=2" in ln for ln in out)


def test_the_recorded_run_says_what_each_variant_computed_in() -> None:
    data = json.loads(bench.JSON.read_text())
    for key in ("date", "commit", "machine", "command", "host", "factor"):
        assert data.get(key), key
    assert {r["variant"] for r in data["runs"]} == set(bench.VARIANTS)
    assert all(r["plan"] and r["computed"] != "?" for r in data["runs"])
    table = bench.render(data)
    assert table.rstrip("\n").splitlines()[-1].startswith("Measured ") and "|---" in table


def test_the_upcast_preset_measures_train_cpu_precision_upcast_against_the_same_fp32_config() -> None:
    fix = "bf16, train.cpu_precision=upcast"
    assert list(bench.variants("upcast")) == [fix, bench.FP32]
    assert bench.overrides(4, 4, fix, "upcast")[-1] == "train.cpu_precision=upcast"
    assert bench.round_order(1, "upcast") == [bench.FP32, fix]
    runs = []
    for k in range(2):
        runs += [_run(k, fix, 11.0, loss=5.51), _run(k, bench.FP32, 10.0)]
    s = bench.summarise(runs, {"bf16_s": 15.0, "fp32_s": 0.1}, layers=4, quiet_max=0.25)
    assert list(s["variants"]) == [fix, bench.FP32] and s["ratio"] == pytest.approx(1.1)
    assert s["loss_max_diff"] == pytest.approx(0.01)  # bf16 states: not fp32's numbers
    upcast_plan = [
        "zoff plan: world size 1 (gloo), ZeRO stage 3, torch.bfloat16 states, torch.float32 compute"
    ]
    assert bench.computed(upcast_plan) == "fp32"
    assert bench.parse(["--preset", "upcast"])[1].out == bench.PRESETS["upcast"].json
