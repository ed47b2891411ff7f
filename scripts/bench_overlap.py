#!/usr/bin/env python
"""The disk tier's step with and without zero.offload_optimizer.overlap_step, interleaved in one job (issue 32).

    python scripts/bench_overlap.py                          # the 3.4B demo, 2 rounds of 6 steps a run
    python scripts/bench_overlap.py --rounds 2 --steps 5 model.n_layer=8 zero.offload_optimizer.host_budget=6GiB
    python scripts/bench_overlap.py --render
    python scripts/bench_overlap.py --preset offload          # zero3-offload: its own JSON, same table

--preset offload runs 6 of the demo's 30 layers on zero3-offload (parameters and optimizer states in host
memory, no disk): the overlapped step's walk is then the CPU Adam alone, run beside the next forward. On this
CPU-only host the forward and the CPU Adam share the same two cores, so the overlap can only hide what neither
uses (the step's Python and the host's stalls); on a GPU host the forward runs on the GPU and the Adam on the
cores, which is where the overlap is for (not measured here). Its JSON is bench_overlap_offload.json, rendered
in the docs' region `<!-- render: bench_overlap --preset offload -->`.

Each round trains the config twice, overlap off and on, in alternating order (off on, on off, ...: this
host's memory bandwidth switches modes, its disk stalls now and then, and other work shares it), and the
result is the median over rounds of the per-round ratio of the runs' steady step times (on / off). A run's
steady step time is the median of its steps 2..N-1: the first allocates and warms up, and the last step of an
overlapped run ends before its walk does (the walk joins at the final evaluation), so it would look faster
than it is. Beside the time: the optimizer phase the step waits for (the whole walk off; on, the walk that
runs beside the next forward, and what of it the forward waited for is in the step), rank 0's peak RSS
(metrics.jsonl), and whether the losses of every run are the same, bit for bit (they must be: the overlapped
step is the same arithmetic, only run later).

On a CPU without fast kernels for the config's 16-bit precision (no AVX512: bf16 ~100x fp32's time) every run
computes in fp32 (train.cpu_precision=fp32 after the other overrides; the JSON's cpu_precision and the table
say so); --native-precision keeps the 16-bit compute, and its hours.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import benchlib

from zoff.config import CONFIGS_DIR, load_config

PRESETS = {
    "default": benchlib.Preset(benchlib.RESULTS / "bench_overlap.json"),
    # 6 of the demo's 30 layers: every state in this host's RAM (0.69B parameters, 11 GB of model states)
    "offload": benchlib.Preset(
        benchlib.RESULTS / "bench_overlap_offload.json",
        ("model.n_layer=6", "zero.offload_optimizer.device=cpu", "zero.offload_param.device=cpu"),
    ),
}
JSON = PRESETS["default"].json
DEFAULT_CONFIG = CONFIGS_DIR / "gpt-3b-nvme.yaml"
MODES = {
    "off": "zero.offload_optimizer.overlap_step=false",
    "on": "zero.offload_optimizer.overlap_step=true",
}
COMMON = ["train.log_every=1", "train.eval_batches=1", "checkpoint.enabled=false", "log.progress=false"]


def run(config: Path, overrides: list[str], steps: int) -> dict:
    """One `zoff train` of `config` for `steps` steps: steady step and optimizer-phase medians, losses, peak RSS."""
    steps_rows = benchlib.train_records(
        config, [*overrides, *COMMON, f"train.max_steps={steps}"], "bench_overlap"
    )
    steady = steps_rows[1:-1] or steps_rows
    walk = [r.get("last_walk_s") or r.get("optimizer_s", 0.0) for r in steady]
    return {"step_s": statistics.median(r["step_time_s"] for r in steady),
            "step_times_s": [r["step_time_s"] for r in steps_rows],
            "walk_s": statistics.median(walk),
            "peak_rss_mib": max(r.get("peak_rss_mib", 0.0) for r in steps_rows),
            "losses": [r["loss"] for r in steps_rows]}  # fmt: skip


def render(data: dict) -> str:
    rows = [f"| {r['round']} | {r['order']} | {r['off']['step_s']:.1f} | {r['on']['step_s']:.1f} | {r['ratio']:.3f} "
            f"| {r['off']['walk_s']:.1f} | {r['on']['walk_s']:.1f} | {r['off']['peak_rss_mib'] / 1024:.1f} "
            f"| {r['on']['peak_rss_mib'] / 1024:.1f} |" for r in data["rounds"]]  # fmt: skip
    same = "the same in every run, bit for bit" if data["same_losses"] else "**different**: see the JSON"
    extra = " ".join(f"`{o}`" for o in data["overrides"]) or "none"
    return "\n".join([
        f"`{data['config']}` (overrides: {extra}), {data['steps']} steps a run, overlap_step off and on"
        " interleaved; step = median of steps 2..N-1.",
        "",
        "| round | order | off: step, s | on: step, s | on / off | off: optimizer phase, s | on: its walk, s "
        "| off: peak RSS, GiB | on: peak RSS, GiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Median of the per-round ratios: **{data['median_ratio']:.3f}** (below 1: the overlapped step is"
        f" faster). Losses: {same}.",
        "",
        benchlib.measured_line(data, "bench_overlap"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.preset_args(ap, PRESETS)  # first: the recorded command reads `--preset offload --steps 5`
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="train.max_steps of each run (at least 4)")
    ap.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE overrides for both modes (off, on)")
    benchlib.native_precision_arg(ap)
    a = ap.parse_args(argv)
    overrides = [*a.overrides, *benchlib.resolve_output(a, PRESETS).overrides]  # the preset's last
    if a.render:
        return benchlib.print_rendered(a.out, render)
    train = load_config(a.config, overrides).train
    cpu = benchlib.cpu_precision_plan(
        "bench_overlap", train.precision, a.native_precision, cpu_precision=train.cpu_precision
    )
    overrides += cpu.overrides  # (fp32 where the config's 16-bit kernels are slow here)
    if a.steps < 4:
        ap.error("--steps: at least 4 (steps 2..N-1 are timed)")
    rounds = benchlib.interleaved_rounds(
        ("off", "on"), a.rounds, lambda name: run(a.config, [*overrides, MODES[name]], a.steps)
    )
    data = benchlib.interleaved_result(ap, a, "bench_overlap", overrides, cpu, rounds)
    return benchlib.write_result(a.out, data, render)


if __name__ == "__main__":
    sys.exit(main())
