#!/usr/bin/env python
"""Benchmark zoff's fused CPU Adam against torch's AdamW, each called as its users call it, and a ceiling.

Not a test. Every optimizer owns its own parameters, gradients and state, built the way a user builds them:
`torch.optim.AdamW(params, ..., fused=True)` / `AdamW(params, ...)` (torch's default, which on CPU is the
per-tensor for-loop: foreach is only the default on CUDA) / `foreach=True`, and `zoff.optim.CPUAdam(params,
...)` with its default thread count (torch's), each driven by `.step()` with `.grad` set and its state created
by its own first steps. Two layouts: one flat fp32 tensor of n params (the offload engine's shard, where zoff
also runs its functional `cpu_adam_step` and the bf16-grad-in/bf16-copy-out step), and a GPT-like list of
parameter tensors summing to n (12 per block plus an embedding). Ceilings on their own arrays: a probe with
exactly an Adam step's traffic (read 4 arrays, write 3) and a STREAM triad. The probe is compiled with the
kernel and shares its software prefetch: where that prefetch costs (as on AMD EPYC family 26 hosts, 2026-11-23)
a plain vectorized loop such as torch's can beat the probe, and "% of probe" exceeds 100.

This host's memory bandwidth switches between modes ~1.7x apart and other work shares it, so only ratios
within a round mean something. In one process, per size, each round makes `reps` passes; a pass steps every
fast variant once, each step timed (A B C ... A B C ..., the starting variant rotated per pass), and the slow
torch variants (default, foreach) once per round. A round keeps each variant's median step. Other processes'
CPU time is metered per round (/proc/stat less this process); rounds run until --rounds of them were quiet
(< --quiet-max other busy cores; at most 3x --rounds), and only quiet rounds count when there are 3 or more.
The table reports medians over rounds of per-round ratios: "% of probe" = probe time / variant time (an Adam
step at the probe's speed reads 100%), and "x" = peer time / zoff time (> 1: zoff is faster).

    python scripts/bench_adam.py [--sizes 1M,16M,64M] [--rounds 9] [--threads 2[,1]] [--quiet-max 0.25]
                                [--out docs/results/bench_adam.json]
    python scripts/bench_adam.py --render   # the markdown table from the JSON (what the docs embed)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

from zoff.optim import CPUAdam, backend_info  # noqa: E402
from zoff.optim.cpu_adam import cpu_adam_step, extension  # noqa: E402

JSON = benchlib.RESULTS / "bench_adam.json"
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# Bytes each variant must move per parameter (counted as STREAM does, no write-allocate traffic).
BYTES = {
    "zoff CPUAdam": 28,  # read p g m v, write p m v
    "zoff cpu_adam_step": 28,  # the offload engine's call on a flat shard
    "torch fused": 28,
    "zoff mixed": 28,  # read p4 g2(bf16) m4 v4, write p4 m4 v4 + bf16 copy 2
    "torch fused+copy": 34,  # fused step on fp32 grads (no upcast counted) + read p4 write bf16 2
    "model: zoff CPUAdam": 28,
    "model: torch fused": 28,
    "model: torch default": 28,  # the minimum; the for-loop makes ~10 passes
    "model: torch foreach": 28,
    "probe": 28,
    "triad": 12,
}
SLOW = ("model: torch default", "model: torch foreach")  # ~15x a fused step: once per round
ORDER = list(BYTES)
SPEEDUPS = {  # label: (peer, zoff)
    "zoff CPUAdam vs torch fused (flat)": ("torch fused", "zoff CPUAdam"),
    "zoff CPUAdam vs torch fused (model)": ("model: torch fused", "model: zoff CPUAdam"),
    "zoff CPUAdam vs torch default (model)": ("model: torch default", "model: zoff CPUAdam"),
    "zoff CPUAdam vs torch foreach (model)": ("model: torch foreach", "model: zoff CPUAdam"),
    "zoff mixed vs torch fused+copy": ("torch fused+copy", "zoff mixed"),
}


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def model_shapes(n: int) -> list[tuple[int, ...]]:
    """A GPT-like parameter list of exactly n elements: blocks of (qkv, proj, fc, fc2 weights and biases, two
    norms' gains and biases) at d_model 512 (128 below 4M params), the rest as an embedding (vocab x d)."""
    d = 512 if n >= 4 << 20 else 128
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d)] + [(d,)] * 5
    per = sum(math.prod(s) for s in block)
    layers = n // per
    rest = n - layers * per
    shapes = ([(rest // d, d)] if rest >= d else []) + block * layers
    return shapes + ([(rest % d,)] if rest % d else [])


def make_params(shapes: list[tuple[int, ...]], gen: torch.Generator) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def make_variants(n: int) -> dict[str, Callable[[], object]]:
    """One closure per variant, each one step; every optimizer on its own fresh tensors, stepped twice here so
    its state exists and every page has been touched before timing."""
    ext = extension()
    if ext is None:
        raise SystemExit(f"fused kernel unavailable: {backend_info()['reason']}")
    gen = torch.Generator().manual_seed(n)
    flat, model = [(n,)], model_shapes(n)
    v: dict[str, Callable[[], object]] = {}
    v["zoff CPUAdam"] = CPUAdam(make_params(flat, gen), **HP).step
    fused = torch.optim.AdamW(make_params(flat, gen), **HP, fused=True)
    v["torch fused"] = fused.step
    v["model: zoff CPUAdam"] = CPUAdam(make_params(model, gen), **HP).step
    v["model: torch fused"] = torch.optim.AdamW(make_params(model, gen), **HP, fused=True).step
    v["model: torch default"] = torch.optim.AdamW(make_params(model, gen), **HP).step
    v["model: torch foreach"] = torch.optim.AdamW(make_params(model, gen), **HP, foreach=True).step

    # The engine's functional step on a flat shard, fp32 and mixed (bf16 grad in, bf16 param copy out).
    (p,) = make_params(flat, gen)
    p, g, m, s = p.detach(), p.grad, torch.zeros(n), torch.zeros(n)
    g16, out16, step = g.to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16), [0]
    b1, b2 = HP["betas"]
    kw = dict(lr=HP["lr"], beta1=b1, beta2=b2, eps=HP["eps"], weight_decay=HP["weight_decay"])

    def zoff_fn(grad: torch.Tensor = g, out: torch.Tensor | None = None) -> None:
        step[0] += 1
        cpu_adam_step(p, grad, m, s, step=step[0], out16=out, **kw)

    fused_param = fused.param_groups[0]["params"][0]
    v["zoff cpu_adam_step"] = zoff_fn
    v["zoff mixed"] = lambda: zoff_fn(g16, out16)
    v["torch fused+copy"] = lambda: (fused.step(), out16.copy_(fused_param))  # a torch user's bf16 copy

    # Ceilings on their own arrays (the probe adds g to p, m and v: Adam state sharing them would turn NaN).
    pa, ga, ma, va = (torch.randn(n, generator=gen) for _ in range(4))
    ta = torch.empty(n)
    v["probe"] = lambda: ext.stream_probe(pa, ga, ma, va, 0)
    v["triad"] = lambda: ext.stream_triad(ta, pa, ga, 0.5, 0)
    for name in ORDER:
        v[name]()
        v[name]()
    return {k: v[k] for k in ORDER}


def cpu_sample() -> tuple[float, float, float]:
    """(CPU seconds all processes spent busy, this process's CPU seconds, wall clock): the other-work meter."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system, time.perf_counter()


def bench_size(n: int, rounds: int, threads: int, quiet_max: float) -> dict:
    load_before = os.getloadavg()
    variants = make_variants(n)
    t0 = time.perf_counter()
    variants["probe"]()
    reps = min(30, max(5, round(0.05 / (time.perf_counter() - t0))))
    fast = [k for k in ORDER if k not in SLOW]
    med: dict[str, list[float]] = {k: [] for k in ORDER}
    fastest: dict[str, list[float]] = {k: [] for k in ORDER}
    others: list[float] = []  # cores other processes kept busy, per round
    # Rounds run until `rounds` of them were quiet (other processes kept < quiet_max cores busy), at most 3x:
    # a busy neighbour preempts one of two threads and every barrier of that step waits for it.
    while sum(o < quiet_max for o in others) < rounds and len(others) < 3 * rounds:
        c0 = cpu_sample()
        steps: dict[str, list[float]] = {k: [] for k in ORDER}
        for i in range(reps):
            j = i % len(fast)
            order = fast[j:] + fast[:j] + (list(SLOW) if i == reps // 2 else [])
            for name in order:
                t0 = time.perf_counter()
                variants[name]()
                steps[name].append(time.perf_counter() - t0)
        for k in ORDER:
            med[k].append(statistics.median(steps[k]))
            fastest[k].append(min(steps[k]))
        c1 = cpu_sample()
        others.append(max(0.0, (c1[0] - c0[0] - (c1[1] - c0[1])) / (c1[2] - c0[2])))
        print(f"  n={label(n)} t={threads} round {len(others)} (other work {others[-1]:.2f} cores): "
              + " ".join(f"{k}={med[k][-1] * 1e3:.2f}" for k in ORDER))  # fmt: skip
    quiet = [i for i, o in enumerate(others) if o < quiet_max]
    used = quiet if len(quiet) >= 3 else list(range(len(others)))  # too few quiet rounds: all, flagged

    def ratio(a: str, b: str, by: dict[str, list[float]]) -> float:
        return statistics.median(by[a][i] / by[b][i] for i in used)

    rows = {}
    for k in ORDER:
        t = statistics.median(med[k][i] for i in used)
        rows[k] = {
            "ms_per_step": t * 1e3,
            "params_per_s": n / t,
            "gb_per_s": BYTES[k] * n / t / 1e9,
            "bytes_per_param": BYTES[k],
            "pct_of_probe": 100 * ratio("probe", k, med),
            "pct_of_probe_fastest_step": 100 * ratio("probe", k, fastest),
            "round_median_ms": [x * 1e3 for x in med[k]],
            "round_fastest_ms": [x * 1e3 for x in fastest[k]],
        }
    speedups = {lab: ratio(a, b, med) for lab, (a, b) in SPEEDUPS.items()}
    speedups_fastest = {lab: ratio(a, b, fastest) for lab, (a, b) in SPEEDUPS.items()}
    del variants
    gc.collect()
    return {
        "n": n,
        "threads": threads,
        "reps": reps,
        "model_tensors": len(model_shapes(n)),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "rounds_run": len(others),
        "rounds_used": used,
        "quiet_rounds": len(quiet),
        "other_work_cores": statistics.median(others[i] for i in used),
        "other_work_cores_per_round": others,
        "rows": rows,
        "speedups": speedups,
        "speedups_fastest_step": speedups_fastest,
    }


def label(n: int) -> str:
    return f"{n / (1 << 20):g}M" if n >= 1 << 20 else f"{n / (1 << 10):g}K"


def print_table(results: list[dict]) -> None:
    head = f"{'size':>5} {'thr':>3} {'variant':<21} {'ms/step':>9} {'Mparam/s':>9} {'GB/s':>7} {'%probe':>7}"
    print(head)
    print("-" * len(head))
    for res in results:
        tag, t = label(res["n"]), res["threads"]
        for k, row in res["rows"].items():
            print(f"{tag:>5} {t:>3} {k:<21} {row['ms_per_step']:9.2f} {row['params_per_s'] / 1e6:9.0f} "
                  f"{row['gb_per_s']:7.1f} {row['pct_of_probe']:6.1f}%")  # fmt: skip
        for k, s in res["speedups"].items():
            print(f"{tag:>5} {t:>3}   {k}: {s:.3f}x")
        lb, la = res["loadavg_before"], res["loadavg_after"]
        print(f"{tag:>5} {t:>3}   load average {lb[0]:.2f} -> {la[0]:.2f}; {len(res['rounds_used'])} of "
              f"{res['rounds_run']} rounds used (other processes: {res['other_work_cores']:.2f} cores busy); "
              f"{res['model_tensors']} model tensors")  # fmt: skip
        print()


def targets(results: list[dict]) -> dict[str, bool]:
    out = {}
    for res in results:
        if res["n"] < 16 * (1 << 20):
            continue
        tag = f"{label(res['n'])} t={res['threads']}"
        sp = res["speedups"]
        out[f"{tag} CPUAdam >= 95% of probe"] = res["rows"]["zoff CPUAdam"]["pct_of_probe"] >= 95
        out[f"{tag} CPUAdam >= 1.0x torch fused (flat)"] = sp["zoff CPUAdam vs torch fused (flat)"] >= 1.0
        out[f"{tag} CPUAdam >= 1.0x torch fused (model)"] = sp["zoff CPUAdam vs torch fused (model)"] >= 1.0
        out[f"{tag} mixed >= 1.2x fused+copy"] = sp["zoff mixed vs torch fused+copy"] >= 1.2
    return out


def kernel_modified() -> bool:
    """Whether the kernel, its wrappers or this script differ from HEAD: the commit's "+dirty" says only that
    something in the tree does."""
    paths = ("zoff/optim", "zoff/csrc", "scripts/bench_adam.py")
    root = Path(__file__).resolve().parent.parent
    try:
        git = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths], cwd=root, capture_output=True, text=True
        )
    except OSError:
        return False
    return bool(git.stdout.strip())


def machine() -> dict:
    """benchlib's machine() plus what the kernel's speed depends on: the CPU family/model (its prefetch tuning)
    and the SIMD path zoff chose."""
    info = {}
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            key = ln.split(":", 1)[0].strip()
            if key in ("cpu family", "model") and key not in info:
                info[key] = ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "cpu_family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
        "zoff_backend": backend_info(),
    }


# The table's columns: (header, row key in a result's "rows", what of it); "vs" columns read "speedups".
PCT = (("zoff CPUAdam, % of probe", "zoff CPUAdam"), ("`cpu_adam_step`, %", "zoff cpu_adam_step"),
       ("torch fused, %", "torch fused"))  # fmt: skip
VS = (
    ("vs torch fused, flat", "zoff CPUAdam vs torch fused (flat)", 2),
    ("vs torch fused, param list", "zoff CPUAdam vs torch fused (model)", 2),
    ("vs torch default (for-loop), list", "zoff CPUAdam vs torch default (model)", 1),
    ("vs torch foreach, list", "zoff CPUAdam vs torch foreach (model)", 1),
    ("zoff bf16 step vs fused + `.to(bf16)`", "zoff mixed vs torch fused+copy", 2),
)


def render(data: dict) -> str:
    """The markdown table the docs embed: per size and thread count, zoff against the probe and its peers
    (medians over rounds of per-round ratios; "vs" = peer time / zoff time); pure."""
    rows = []
    for res in data["results"]:
        r = res["rows"]
        rows.append(
            [label(res["n"]), str(res["threads"]), f"{r['zoff CPUAdam']['ms_per_step']:.2f}"]
            + [f"{r[k]['pct_of_probe']:.0f}%" for _, k in PCT]
            + [f"{r['probe']['gb_per_s']:.0f}"]
            + [f"{res['speedups'][k]:.{d}f}x" for _, k, d in VS]
            + [f"{len(res['rounds_used'])}/{res['rounds_run']}", f"{res['other_work_cores']:.2f}"]
        )
    header = ["params", "threads", "zoff CPUAdam ms/step", *(h for h, _ in PCT), "probe GB/s"]
    header += [h for h, _, _ in VS] + ["rounds used", "other busy cores"]
    m = data["machine"]
    tensors = {label(res["n"]): res["model_tensors"] for res in data["results"]}  # in the run's size order
    out = [
        f"zoff's {m['zoff_backend']['backend']} kernel ({m['zoff_backend']['simd']}), CPU family/model "
        f"{m['cpu_family_model']}; {data['rounds']} quiet rounds wanted (< {data['quiet_max_cores']:.2f} other "
        "busy cores), medians over rounds of per-round ratios; the parameter list has "
        + ", ".join(f"{n} tensors at {size}" for size, n in tensors.items())
        + ".\n\n",
        benchlib.md_table(header, rows),
        "\n",
    ]
    if data["targets"]:  # the targets are for 16M and larger: a run of small sizes has none
        verdicts = [[k, "PASS" if ok else "MISS"] for k, ok in data["targets"].items()]
        out += [benchlib.md_table(["target", "result"], verdicts), "\n"]
    return "".join(out) + benchlib.measured_line(data, "bench_adam")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="comma-separated param counts (K/M suffixes)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", default="2", help="thread count(s), comma-separated: torch.set_num_threads")
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument(
        "--quiet-max", type=float, default=0.25, help="a round is quiet below this many other busy cores"
    )
    ap.add_argument("--render", action="store_true", help="only print the markdown table from --out's JSON")
    args = ap.parse_args()
    if args.render:
        sys.exit(benchlib.print_rendered(args.out, render))
    prov = benchlib.provenance()
    info = {**prov["machine"], **machine()}
    commit, dirty = prov["commit"], kernel_modified()
    print(f"{info['cpu']} (family/model {info['cpu_family_model']}), {info['cores']} cores, torch {info['torch']}, "
          f"zoff {info['zoff_backend']['backend']}/{info['zoff_backend']['simd']}, commit {commit}"
          f"{' (kernel modified)' if dirty else ''}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    results = []
    for threads in (int(t) for t in str(args.threads).split(",")):
        torch.set_num_threads(threads)  # both peers use torch's thread count (CPUAdam's default)
        results += [
            bench_size(parse_size(s), args.rounds, threads, args.quiet_max) for s in args.sizes.split(",")
        ]
    print()
    print_table(results)
    verdict = targets(results)
    for k, ok in verdict.items():
        print(f"target {k}: {'PASS' if ok else 'FAIL'}")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        **prov,
        "machine": info,
        "command": benchlib.command_line(ap, args, "bench_adam"),
        "modified": dirty,
        "threads": args.threads,
        "rounds": args.rounds,
        "quiet_max_cores": args.quiet_max,
        "hyper_parameters": HP,
        "results": results,
        "targets": verdict,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    sys.stdout.write(render(payload))


if __name__ == "__main__":
    main()
