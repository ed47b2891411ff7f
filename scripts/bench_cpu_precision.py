"""The beyond-memory demo on a CPU without fast bf16 kernels, with the named fix, against its fp32 config
(issue 52).

Without AVX512 torch computes bf16 matmuls on the CPU with a reference kernel (zoff.host.kernels): the demo
(configs/gpt-3b-nvme.yaml, bf16) takes hours a step there. `train.cpu_precision=auto` computes in fp32 on such
a host. This script trains the demo at --layers (4) with every state in RAM (zero=zero3-offload: the disk plays
no part) in two variants, alternating round by round (A B, B A, ...): (a) the configured bf16 with
train.cpu_precision=auto, (b) the same config with train.precision=fp32. Per round it takes each variant's
median step (the first step, a warm-up, left out) and reports the median over rounds of the per-round ratio
a/b against the target (<= 1.5x). Other processes' CPU is metered per run (/proc/stat less this job's): rounds
run until --rounds of them were quiet (< --quiet-max other busy cores; at most 3x --rounds), and only quiet
rounds count where there are any. Each run's plan says what it computed in, and the JSON keeps those lines and
both variants' losses (equal where auto chose fp32). The factor is measured in the same job: the trainer's
probe (kernels.matmul_path, one core, a @ b) and the three matmuls of one of the demo's linear layers at its
own shape (micro-batch x seq_len tokens, d_model x d_model weight): forward x @ W.T, input gradient g @ W and
weight gradient g.T @ x, each in bf16 (once: ~14 s for g @ W on the slow path) and fp32 (best of 3) at the rank's
thread count. The layout matters there: torch's reference bf16 kernel computes x @ W.T tens of times faster than
g @ W, so a step's factor is not one matmul's. The native bf16 demo itself is not run (hours): its step is
predicted from the fp32 variant's, each block's 12 d_model^2 of weights (qkv 3, out 1, MLP 4 + 4) adding those
three matmuls' bf16 time less their fp32 time.

With --preset upcast the fix measured is train.cpu_precision=upcast instead (fp32 compute over the bf16
states: zoff/models/upcast.py), into its own JSON; its losses differ from the fp32 config's (bf16 storage).

    python scripts/bench_cpu_precision.py [--layers 4] [--steps 4] [--rounds 2] [--preset upcast]
    python scripts/bench_cpu_precision.py --dry-run     # the runs it would start, and nothing else
    python scripts/bench_cpu_precision.py --render      # only print the table from the JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import benchlib
import torch

from zoff.config import load_config
from zoff.host import kernels

# which named fix a preset measures against the fp32 config (train.cpu_precision's value), and its JSON
PRESETS = {
    "default": benchlib.Preset(benchlib.RESULTS / "bench_cpu_precision.json"),
    "upcast": benchlib.Preset(benchlib.RESULTS / "bench_cpu_precision_upcast.json"),
}
FIXES = {"default": "auto", "upcast": "upcast"}
JSON = PRESETS["default"].json
CONFIG = benchlib.REPO / "configs" / "gpt-3b-nvme.yaml"
TARGET = 1.5  # the fix's step over the fp32 config's (issue 52's done-when)
FP32 = "fp32 config (train.precision=fp32)"


def variants(preset: str = "default") -> dict[str, list[str]]:
    """The preset's two variants, the fix first: label -> its overrides."""
    fix = f"train.cpu_precision={FIXES[preset]}"
    return {f"bf16, {fix}": [fix], FP32: ["train.precision=fp32"]}


VARIANTS = variants()
FIX = next(iter(VARIANTS))  # the default preset's fix
# every state in RAM (the disk plays no part), no checkpoint, a record per step
BASE = ["zero=zero3-offload", "checkpoint.enabled=false", "train.log_every=1"]
DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def overrides(layers: int, steps: int, variant: str, preset: str = "default") -> list[str]:
    return [*BASE, f"model.n_layer={layers}", f"train.max_steps={steps}", *variants(preset)[variant]]


def round_order(rnd: int, preset: str = "default") -> list[str]:
    """Round `rnd`'s variants in run order: A B, B A, ... (a drift of the host's speed weighs on both alike)."""
    names = list(variants(preset))
    return names if rnd % 2 == 0 else names[::-1]


def quiet_rounds(runs: list[dict], quiet_max: float) -> list[int]:
    """The rounds whose every run saw other processes keep fewer than `quiet_max` cores busy."""
    rounds = sorted({r["round"] for r in runs})
    return [k for k in rounds if all(r["other_cores"] < quiet_max for r in runs if r["round"] == k)]


# ------------------------------------------------------------------------------------- the host and its factor
def host_kind() -> dict:
    """What decides the bf16 matmul path: AVX512 in the CPU's flags, torch's oneDNN bf16 kernel, torch's
    CPU capability."""
    try:
        flags = next(
            (ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
            [],
        )  # fmt: skip
    except OSError:
        flags = []
    try:
        bf16_kernel: bool | None = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        bf16_kernel = None
    return {
        "avx512": any(f.startswith("avx512") for f in flags),
        "flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
        "bf16_kernel": bf16_kernel,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _timed(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


# a linear layer's matmuls, x: tokens x d_in, W: d_out x d_in, g: tokens x d_out (nn.Linear's layout)
LINEAR_OPS = {
    "forward x @ W.T": lambda x, w, g: torch.nn.functional.linear(x, w),
    "input grad g @ W": lambda x, w, g: torch.mm(g, w),
    "weight grad g.T @ x": lambda x, w, g: torch.mm(g.t(), x),
}
WEIGHTS_PER_BLOCK = 12  # the builtin GPT block's weights in d_model^2: qkv 3, out 1, MLP 4 + 4


def measure_factor(rows: int, d_model: int, threads: int) -> dict:
    """The probe's factor (one core) and the LINEAR_OPS of a d_model x d_model layer on `rows` tokens, bf16 and
    fp32, at `threads` (the rank's). bf16 is timed once (seconds on the slow path), fp32 best of 3 after a
    warm-up; the factor is their sums' ratio (a layer's forward and backward)."""
    probe = kernels.matmul_path(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    ops = {}
    try:
        x, w, g = torch.randn(rows, d_model), torch.randn(d_model, d_model), torch.randn(rows, d_model)
        for name, op in LINEAR_OPS.items():
            op(x, w, g)  # (warm-up: the first call allocates)
            fp32_s = _timed(functools.partial(op, x, w, g), 3)
            bf16 = functools.partial(op, x.bfloat16(), w.bfloat16(), g.bfloat16())
            ops[name] = {"bf16_s": _timed(bf16, 1), "fp32_s": fp32_s}
    finally:
        torch.set_num_threads(before)
    bf16_s, fp32_s = (sum(o[k] for o in ops.values()) for k in ("bf16_s", "fp32_s"))
    return {
        "probe": {"factor": probe.factor, "kernel": probe.kernel, "source": probe.source, "describe": probe.describe()},
        "demo_matmul": {"shape": [rows, d_model, d_model], "threads": threads, "ops": ops, "bf16_s": bf16_s,
                        "fp32_s": fp32_s, "factor": bf16_s / fp32_s},
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------- the runs
def _cpu_now() -> tuple[float, float, float]:
    """(CPU seconds every process spent busy, this job's own and its finished children's, wall clock)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.perf_counter()


def plan_lines(stdout: list[str]) -> list[str]:
    """The run's plan lines about what it computed in: the plan's first line and train.cpu_precision's."""
    keep = ("zoff plan:", "train.cpu_precision", "WARNING: bf16", "WARNING: fp16")
    return [ln.strip() for ln in stdout if any(k in ln for k in keep)]


def computed(lines: list[str]) -> str:
    """The precision the plan says the rank computed in ("fp32", from "torch.float32 compute"), else "?"."""
    for ln in lines:
        for name, short in DTYPES.items():
            if f"{name} compute" in ln:
                return short
    return "?"


def run_once(config: Path, args: argparse.Namespace, rnd: int, variant: str) -> dict:
    """One `zoff train` of `variant`: its steps, losses, plan lines and the host's other load meanwhile."""
    out: list[str] = []
    load, (busy0, own0, t0) = os.getloadavg()[0], _cpu_now()
    records = benchlib.train_records(
        config, overrides(args.layers, args.steps, variant, args.preset), "bench_cpu_precision", out
    )
    busy1, own1, t1 = _cpu_now()
    lines = plan_lines(out)
    return {
        "round": rnd, "variant": variant, "plan": lines, "computed": computed(lines),
        "step_s": [r["step_time_s"] for r in records],
        "compute_s": [r.get("forward_s", 0.0) + r.get("backward_s", 0.0) for r in records],
        "loss": [r["loss"] for r in records], "loadavg_before": load, "wall_s": t1 - t0,
        "other_cores": max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------ summary (pure)
def _steady(xs: list[float]) -> list[float]:
    return xs[1:] or xs  # the first step warms up


def summarise(runs: list[dict], matmul: dict, layers: int, quiet_max: float) -> dict:
    """Per variant the median over rounds of its per-round median step; the per-round ratios fix/fp32, their
    median against TARGET; whether the losses agree; the native bf16 step predicted from the fp32 one (each
    block's weights' matmuls, `matmul` (measure_factor's demo_matmul), at bf16's time less fp32's). Only the
    quiet rounds (quiet_rounds) count, or every round where none was quiet."""
    quiet = quiet_rounds(runs, quiet_max)
    rounds = quiet or sorted({r["round"] for r in runs})
    fix = next(r["variant"] for r in runs if r["variant"] != FP32)  # the preset's fix
    med = {(r["round"], r["variant"]): statistics.median(_steady(r["step_s"])) for r in runs}
    ratios = [med[(k, fix)] / med[(k, FP32)] for k in rounds]
    ratio = statistics.median(ratios)
    out = {}
    for v in (fix, FP32):
        mine = [r for r in runs if r["variant"] == v]
        out[v] = {
            "step_s": statistics.median(med[(k, v)] for k in rounds),
            "computed": sorted({r["computed"] for r in mine}),
        }
    ref = out[FP32]
    losses = {v: [r["loss"] for r in runs if r["variant"] == v] for v in out}
    diff = max(abs(a - b) for x, y in zip(losses[fix], losses[FP32]) for a, b in zip(x, y))
    return {
        "variants": out, "rounds_run": len({r["round"] for r in runs}), "rounds_used": rounds,
        "quiet_rounds": len(quiet),        "quiet_max_cores": quiet_max, "ratios": ratios, "ratio": ratio, "target": TARGET,
        "result": "PASS" if ratio <= TARGET else "MISS", "loss_max_diff": diff,
        "predicted_native_step_s": ref["step_s"]
        + layers * WEIGHTS_PER_BLOCK * (matmul["bf16_s"] - matmul["fp32_s"]),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------- render (pure)
def _rounds_text(s: dict) -> str:
    """Which rounds the medians count: the quiet ones of those run, or all where none was quiet."""
    run, quiet, limit = (
        s["rounds_run"],
        s["quiet_rounds"],
        f"other processes < {s['quiet_max_cores']:.2f} cores busy",
    )
    if quiet == 0:
        return f"every one of {run} round(s), none quiet ({limit}): other work shared the cores"
    if quiet == run:
        return f"{run} round(s), each quiet ({limit})"
    return f"the {quiet} quiet round(s) of {run} ({limit})"


def render(data: dict) -> str:
    s, host, f = data["summary"], data["host"], data["factor"]
    rows = []
    for v, row in s["variants"].items():
        ratio = f"{s['ratio']:.2f}x" if v != FP32 else "1.00x"
        target = f"<= {s['target']:.1f}x: {s['result']}" if v != FP32 else ""
        rows.append([v, ", ".join(row["computed"]), f"{row['step_s']:.2f}", ratio, target])
    table = benchlib.md_table(["variant", "computed in", "step s (median)", "ratio to fp32", "target"], rows)
    mm = f["demo_matmul"]
    rows_, k, n = mm["shape"]
    same = "equal" if s["loss_max_diff"] == 0 else f"max difference {s['loss_max_diff']:.2e}"
    avx = "with AVX512" if host["avx512"] else "without AVX512"
    return (
        f"{table}\n"
        f"Ratio per round: {', '.join(f'{x:.3f}' for x in s['ratios'])} (median {s['ratio']:.3f}; "
        f"{_rounds_text(s)}); "
        f"losses of the two variants {same}. Host {avx} (torch CPU capability {host['cpu_capability']}, "
        f"oneDNN bf16 kernel: {host['bf16_kernel']}). The factor, same job: {f['probe']['describe']}; "
        f"the demo's {n}x{k} linear layer on {rows_} tokens at {mm['threads']} threads, bf16 against fp32: "
        + "; ".join(f"{op} {t['bf16_s']:.2f} s / {t['fp32_s']:.3f} s" for op, t in mm.get("ops", {}).items())
        + f"; together {mm['factor']:.0f}x. Predicted, not run: the native bf16 step "
        f"{s['predicted_native_step_s']:.0f} s (the fp32 step, each block's {WEIGHTS_PER_BLOCK} such layers "
        "at bf16's time less fp32's).\n\n" + benchlib.measured_line(data, "bench_cpu_precision")
    )


# ----------------------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="model.n_layer of the demo")
    ap.add_argument("--steps", type=int, default=4, help="steps a run (the first, a warm-up, left out)")
    ap.add_argument(
        "--rounds", type=int, default=2, help="quiet rounds of both variants wanted (at most 3x run)"
    )
    ap.add_argument(
        "--quiet-max", type=float, default=0.25, help="a round is quiet below this many other busy cores"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the runs it would start; measure nothing")
    benchlib.preset_args(ap, PRESETS)
    a = ap.parse_args(argv)
    benchlib.resolve_output(a, PRESETS)
    return ap, a


def measure_runs(a: argparse.Namespace) -> list[dict]:
    """Rounds of both variants until --rounds of them were quiet, at most 3x --rounds."""
    runs: list[dict] = []
    rnd = 0
    while len(quiet_rounds(runs, a.quiet_max)) < a.rounds and rnd < 3 * a.rounds:
        for v in round_order(rnd, a.preset):
            runs.append(r := run_once(CONFIG, a, rnd, v))
            print(f"  round {rnd} {v}: computed in {r['computed']}, steps {[round(x, 2) for x in r['step_s']]}, "
                  f"other cores {r['other_cores']:.2f}", flush=True)  # fmt: skip
        rnd += 1
    return runs


def main(argv: list[str] | None = None) -> int:
    ap, a = parse(argv)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    cfg = load_config(CONFIG, overrides(a.layers, a.steps, FP32))
    if a.dry_run:
        for rnd in range(a.rounds):
            for v in round_order(rnd, a.preset):
                print(f"round {rnd}: zoff train {CONFIG.relative_to(benchlib.REPO)} "
                      + " ".join(overrides(a.layers, a.steps, v, a.preset)))  # fmt: skip
        return 0
    print(f"bench_cpu_precision: load average {os.getloadavg()[0]:.2f}; measuring the factor", flush=True)
    rows = cfg.data.batch_size * cfg.data.seq_len
    factor = measure_factor(rows, cfg.model.d_model, cfg.launch.threads_per_rank)
    print(f"  {factor['probe']['describe']}; demo-shaped: {factor['demo_matmul']['factor']:.0f}x", flush=True)
    runs = measure_runs(a)
    data = benchlib.provenance() | {
        "command": benchlib.command_line(ap, a, "bench_cpu_precision"),
        "config": str(CONFIG.relative_to(benchlib.REPO)), "overrides": BASE, "variants": variants(a.preset),
        "layers": a.layers, "steps": a.steps, "rounds": a.rounds, "host": host_kind(), "factor": factor,
        "runs": runs, "summary": summarise(runs, factor["demo_matmul"], a.layers, a.quiet_max),
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
