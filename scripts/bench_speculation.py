#!/usr/bin/env python
"""Exact speculation (zero.offload_optimizer.speculate) off and on, interleaved in one job (issue 53).

    python scripts/bench_speculation.py                   # the 3.4B demo as configured: the clip triggers every step
    python scripts/bench_speculation.py --preset offload  # zero3-offload, 6 of its layers, the clip above every norm
    python scripts/bench_speculation.py --render

What each preset answers (the step against the floor, with speculation committing, is bench_beyond_memory's
`--preset unclipped` and `unclipped-2g`, which measure the floor and the exact bound in the same job):
  default          the demo from initialisation clips every step (norms 155-456 against train.grad_clip 1.0):
                   speculate auto (the config's) speculates only after a step that did not clip, so it never
                   does; its step against speculate false's (issue 53: at most 1.02x)
  offload          zero3-offload (every state in RAM), 6 layers, clip above every norm (train.grad_clip=1e9):
                   speculate true against false. On this CPU-only host auto leaves the host tier off (the CPU
                   Adam would share backward's two cores), so auto's step is false's; true shows what forcing it
                   costs or gains here
  disk-unclipped   8 of the demo's layers, every state on disk (host budget 2 GiB), one sequence a step, the clip
                   above every norm: a disk-bound step, where speculation moves the walk's I/O into backward;
                   auto (from step 2) against false

Each round runs the config with each setting in alternating order (off on, on off, ...) and the result is the
median over rounds of the per-round ratio of steady step times (on / off; steps 2..N-1: the first allocates,
and the last of an overlapped run ends before its walk does). Per run: the units speculated and committed a
step, backward's time, rank 0's peak RSS, and the losses, which must be the same bit for bit in every run.

On a CPU without fast kernels for the config's 16-bit precision (no AVX512) every run computes in fp32
(train.cpu_precision=fp32); --native-precision keeps the 16-bit compute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import benchlib

from zoff.config import CONFIGS_DIR, load_config

UNCLIPPED = "train.grad_clip=1e9"
# 8 of the demo's layers with every state on disk (the host budget at 2 GiB) and one sequence a step: the disk,
# not this host's compute (fp32 where bf16 has no kernel: 100 s a step of the whole demo), bounds the step
DISK_BOUND = ("model.n_layer=8", "zero.offload_optimizer.host_budget=2GiB", "data.batch_size=1")
OFFLOAD = ("model.n_layer=6", "zero.offload_optimizer.device=cpu", "zero.offload_param.device=cpu")
PRESETS = {  # (the docstring says what each is for); the "on" setting is the preset's last override
    "default": benchlib.Preset(
        benchlib.RESULTS / "bench_speculation.json", ("zero.offload_optimizer.speculate=auto",)
    ),
    "offload": benchlib.Preset(
        benchlib.RESULTS / "bench_speculation_offload.json",
        (*OFFLOAD, UNCLIPPED, "zero.offload_optimizer.speculate=true"),
    ),
    "disk-unclipped": benchlib.Preset(
        benchlib.RESULTS / "bench_speculation_disk_unclipped.json",
        (*DISK_BOUND, UNCLIPPED, "zero.offload_optimizer.speculate=auto"),
    ),
}
JSON = PRESETS["default"].json
DEFAULT_CONFIG = CONFIGS_DIR / "gpt-3b-nvme.yaml"
OFF = "zero.offload_optimizer.speculate=false"
COMMON = ["train.log_every=1", "train.eval_batches=1", "checkpoint.enabled=false", "log.progress=false"]


def run(config: Path, overrides: list[str], steps: int) -> dict:
    """One `zoff train` run: steady step and backward medians, units speculated and committed, losses, RSS."""
    rows = benchlib.train_records(
        config, [*overrides, *COMMON, f"train.max_steps={steps}"], "bench_speculation"
    )
    steady = rows[1:-1] or rows
    med = lambda key: statistics.median(r.get(key, 0) for r in steady)  # noqa: E731
    return {"step_s": med("step_time_s"), "backward_s": med("backward_s"), "forward_s": med("forward_s"),
            "step_times_s": [r["step_time_s"] for r in rows],
            "speculated_units": [r.get("spec_speculated_units", 0) for r in rows],
            "committed_units": [r.get("spec_committed_units", 0) for r in rows],
            "units": rows[0].get("spec_units"),
            "peak_rss_mib": max(r.get("peak_rss_mib", 0.0) for r in rows),
            "grad_norms": [r["grad_norm"] for r in rows], "losses": [r["loss"] for r in rows]}  # fmt: skip


def render(data: dict) -> str:
    def units(v: dict) -> str:
        return f"{sum(v['committed_units'])} of {sum(v['speculated_units'])}" if v["units"] else "-"

    rows = [f"| {r['round']} | {r['order']} | {r['off']['step_s']:.2f} | {r['on']['step_s']:.2f} | {r['ratio']:.3f} "
            f"| {r['off']['backward_s']:.2f} | {r['on']['backward_s']:.2f} | {units(r['on'])} "
            f"| {r['off']['peak_rss_mib'] / 1024:.1f} | {r['on']['peak_rss_mib'] / 1024:.1f} |"
            for r in data["rounds"]]  # fmt: skip
    same = "the same in every run, bit for bit" if data["same_losses"] else "**different**: see the JSON"
    norms = data["rounds"][0]["off"]["grad_norms"]
    clipped = sum(n > data["grad_clip"] for n in norms)
    extra = " ".join(f"`{o}`" for o in data["overrides"]) or "none"
    return "\n".join([
        f"`{data['config']}` (overrides: {extra}), {data['steps']} steps a run, speculate false (off) and "
        f"`{data['on']}` (on) interleaved; step = median of steps 2..N-1. train.grad_clip {data['grad_clip']:g}: "
        f"{clipped} of the {len(norms)} steps' norms above it ({min(norms):.3g}-{max(norms):.3g}).",
        "",
        "| round | order | off: step, s | on: step, s | on / off | off: backward, s | on: backward, s "
        "| on: units committed of speculated (all steps) | off: peak RSS, GiB | on: peak RSS, GiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Median of the per-round ratios: **{data['median_ratio']:.3f}** (below 1: on is faster). Losses: {same}.",
        "",
        benchlib.measured_line(data, "bench_speculation"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.preset_args(ap, PRESETS)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="train.max_steps of each run (at least 4)")
    ap.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE overrides for both settings")
    benchlib.native_precision_arg(ap)
    a = ap.parse_args(argv)
    preset = benchlib.resolve_output(a, PRESETS)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    *shared, on = preset.overrides
    overrides = [*a.overrides, *shared]
    cfg = load_config(a.config, [*overrides, on])
    cpu = benchlib.cpu_precision_plan(
        "bench_speculation", cfg.train.precision, a.native_precision, cpu_precision=cfg.train.cpu_precision
    )
    overrides += cpu.overrides
    if a.steps < 4:
        ap.error("--steps: at least 4 (steps 2..N-1 are timed)")
    settings = {"off": OFF, "on": on}
    rounds = benchlib.interleaved_rounds(
        ("off", "on"), a.rounds, lambda name: run(a.config, [*overrides, settings[name]], a.steps)
    )
    data = benchlib.interleaved_result(
        ap,
        a,
        "bench_speculation",
        overrides,
        cpu,
        rounds,
        on=on.split("=", 1)[1],
        grad_clip=cfg.train.grad_clip,
    )
    return benchlib.write_result(a.out, data, render)


if __name__ == "__main__":
    sys.exit(main())
