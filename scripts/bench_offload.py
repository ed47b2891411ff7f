#!/usr/bin/env python
"""Benchmark ZeRO stage 2 with and without CPU optimizer offload, and with the delayed parameter update (DPU).

Not a test. A ~100M-parameter builtin GPT (12 layers, d_model 768, byte vocabulary: ~85M parameters) trains on
synthetic data with AdamW and gradient clipping at 1.0 (the config default) in three variants:

stage2   zero.stage 2: the partition is stepped by torch's fused CPU AdamW (zoff's ShardOptimizer on the device tier)
offload  + zero.offload_optimizer {device: cpu}: the same partition stepped by zoff's fused C++ CPU Adam
dpu      + delay_update: true, delay_update_warmup 2: the CPU step of step i runs in a background thread
         while forward/backward of step i+1 runs on parameters one step stale

What the numbers mean on a CPU-only machine: there is no device, so offload cannot save device memory or PCIe
traffic here; the "device" buffers and the host buffers are the same RAM (zoff aliases them where it can). What
is measured is (1) the step's cost with zoff's CPU Adam vs torch's fused AdamW on the same cores and memory
bus, including the 16-bit publish copy and everything else the offload path adds or removes, and (2) DPU's
overlap of the CPU step with a forward/backward that competes for the same cores (and memory bandwidth). On a
GPU host, forward/backward would run on the device and DPU's overlap would be nearly free; here it is the
worst case of "two CPU-bound jobs on 2 cores", so a DPU gain here is a lower bound of what it gives with a GPU.
For the same reason the CPU-step share of the step is small here (forward/backward on 2 CPU cores is slow);
on a GPU host forward/backward is one to two orders of magnitude faster and the CPU step (plus the transfers)
becomes the largest part of the step, which is what the offload kernel's speed and DPU are for.

One job per (world size, precision) keeps all three variants alive and interleaves rounds (A B C, B C A, ...;
the rotation evens out position effects). Each variant's block in a round is --steps-per-round timed steps;
the DPU block adds an untimed lead-in step before them and an untimed flush of the update still in flight
after them, so every timed DPU step carries exactly one overlapped CPU step, as in steady state, and no
background work leaks into the next variant's block. (The state of an ~85M model, >1 GiB per variant, is far
larger than the caches, so the other variants' first steps start no colder than their later ones.) This
host's memory bandwidth switches between modes ~1.7x apart and other work shares it, so only ratios within a
round mean something: the table reports medians of per-round ratios (q1-q3); absolute ms are medians for
scale only and are never compared across jobs.

Per step, from engine.stats()["last_step_times"]: optimizer_s (the CPU Adam step; under DPU only the gradient
copy and the launch of the background step), publish_s (16-bit copy of the new params + all-gather),
dpu_wait_s (time the step waited for the previous, delayed CPU step). The engine's dpu_wait_s times all of
flush(), i.e. the join AND the publish of the delayed update, so the script also wraps (never edits) three
engine methods to time the join alone, every publish, and the CPU update itself (in the background thread
under DPU); see instrument(). "CPU-step share" is optimizer_s / step time for the synchronous variants; for
DPU, "hidden" is 1 - join wait / (the offload variant's synchronous optimizer_s in the same round): the
fraction of the CPU step the overlap took off the critical path. "other" is step() minus optimizer_s,
publish_s and dpu_wait_s: the global gradient norm and the clipping, which a probe after the rounds times.

Two probes run on the offload engine's own shards after the rounds (interleaved, medians): the global-norm
and clipping expressions step() uses vs a temporary-free norm (step_overhead_probe), and, for bf16, the
kernel's fused 16-bit copy-out (out16) vs the kernel followed by a separate fp32->bf16 copy, which is what
the engine's publish does today (copy_out_probe).

The reduction of the ranks' records to the JSON's summary, and the tables, are offload_report.py's.

    python scripts/bench_offload.py [--layers 12] [--d-model 768] [--seq-len 128] [--batch 1] [--rounds 5]
        [--steps-per-round 2] [--worlds 1,2] [--precisions fp32,bf16] [--out docs/results/bench_offload.json]
    python scripts/bench_offload.py --render   # the markdown tables from the JSON (what the docs embed)

On this 2-core host a step of the 85M model at 64 tokens took 0.9 s while the host was briefly idle and up to
17 s under other jobs' load; there `--seq-len 64 --rounds 4 --steps-per-round 1` ran all four jobs in ~17 min.

On a CPU without fast bf16 kernels (no AVX512: a bf16 matmul ~100x fp32's time) a bf16 job takes hours, and
computing it in fp32 would make it the fp32 job again: the script refuses in one line (exit 2) and names
--precisions fp32 or --native-precision (the bf16 jobs anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import benchlib
import torch
import torch.distributed as dist
from benchlib import gpt_config, spawn
from offload_report import VARIANTS, print_table, render, summarize

from zoff.config import Config
from zoff.data import GlobalBatches, load_corpus
from zoff.engine import ZeroEngine
from zoff.models import build_model, lm_loss
from zoff.optim import backend_info, cpu_adam_step
from zoff.trainer.session import build_session

JSON = benchlib.RESULTS / "bench_offload.json"
OFFLOAD = {
    "stage2": {"device": "none"},
    "offload": {"device": "cpu"},
    "dpu": {"device": "cpu", "delay_update": True},
}
GiB = 2**30


def make_cfg(args: argparse.Namespace, precision: str, variant: str) -> Config:
    offload = dict(OFFLOAD[variant])
    if offload.get("delay_update"):
        offload["delay_update_warmup"] = args.dpu_warmup
    train = {"grad_clip": args.grad_clip, "precision": precision, "seed": 0}
    return gpt_config(args, {"stage": 2, "offload_optimizer": offload}, train)


def state_bytes_per_param(precision: str, variant: str, world: int) -> float:
    """Model state per rank on this host (design.md §1 plus what offload/DPU keep on the side), for the guard."""
    w = 2 if precision == "bf16" else 4
    master = 4 if precision == "bf16" or variant == "dpu" else 0  # fp32 sync offload/stage2: shard = master
    host_grads = (
        w if variant == "dpu" else 0
    )  # DPU copies the gradient shard: the next backward overwrites it
    return w + (w + master + 8 + host_grads) / world


# ---------------------------------------------------------------------------------------- rank job
def instrument(eng: ZeroEngine) -> dict[str, float]:
    """Time what the engine's own timers lump together, by wrapping (not editing) three of its methods:
    join   waiting for a delayed CPU step (optimizer.finish); the engine's dpu_wait_s also includes the publish
    publish  16-bit copy + all-gather of new params, wherever it happens (under DPU: inside flush)
    cpu_step  the duration of each CPU Adam update (ShardOptimizer._update), in the background thread under DPU
    """
    acc = {"join": 0.0, "publish": 0.0, "cpu_step": 0.0, "cpu_steps": 0}

    def timed(fn, key: str, count: str | None = None):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0
                if count:
                    acc[count] += 1

        return wrapper

    eng.publication.publish_all = timed(eng.publication.publish_all, "publish")
    opt = eng.optimizer
    if opt.tier.kind == "host":
        opt.finish = timed(opt.finish, "join")
        opt._update = timed(opt._update, "cpu_step", "cpu_steps")
    return acc


def run_step(eng: ZeroEngine, acc: dict, x: torch.Tensor, y: torch.Tensor, lr: float, clip: float) -> dict:
    acc.update(join=0.0, publish=0.0, cpu_step=0.0, cpu_steps=0)
    t0 = time.perf_counter()
    eng.zero_grad()
    loss = lm_loss(eng.model(x), y)
    t1 = time.perf_counter()
    eng.backward(loss)
    t2 = time.perf_counter()
    res = eng.step(lr)
    t3 = time.perf_counter()
    st = eng.stats()["last_step_times"]
    # A DPU step's background update completes (and is timed) within the next step, the one it overlaps.
    sync = eng.optimizer.tier.kind != "host"
    return {
        "fwd": t1 - t0,
        "bwd": t2 - t1,
        "step": t3 - t2,
        "total": t3 - t0,
        "optimizer": st["optimizer_s"],
        "publish": st["publish_s"],
        "wait": st["dpu_wait_s"],
        "join": acc["join"],
        "publish_m": acc["publish"],
        "cpu_step": st["optimizer_s"] if sync else acc["cpu_step"],
        "cpu_steps": 1 if sync else acc["cpu_steps"],
        "clipped": bool(clip > 0 and res.grad_norm > clip),
    }


def copy_out_probe(eng: ZeroEngine, reps: int) -> dict:
    """The offload engine's bf16 step as it is (kernel, then publish's separate fp32->bf16 copy) vs the kernel's
    fused out16 copy-out, on this rank's own shards and gradients. Run after the rounds: it steps the state."""
    opt = eng.optimizer
    units = [u for u in range(len(opt.masters)) if opt.masters[u].numel()]
    step = opt.step_count

    def kernel(out16: bool) -> float:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        for u in units:
            cpu_adam_step(
                opt.masters[u], eng.gshard[u], opt.exp_avg[u], opt.exp_avg_sq[u], step=step, lr=1e-5,
                weight_decay=0.1, out16=eng.shard_params[u] if out16 else None, threads=opt.threads,
            )  # fmt: skip
            if not out16:
                eng.shard_params[u].copy_(opt.masters[u])
        return time.perf_counter() - t0

    sep, fused = [], []
    for _ in range(reps):
        dist.barrier()
        sep.append(kernel(False))
        dist.barrier()
        fused.append(kernel(True))
    return {"separate_s": sep, "fused_s": fused, "numel": sum(opt.masters[u].numel() for u in units)}


def step_overhead_probe(eng: ZeroEngine, reps: int) -> dict:
    """What ZeroEngine.step() spends besides the optimizer and the publish, on this rank's gradient shards:
    the global-norm expression it uses (g.float().pow(2).sum(): one or two full-size temporaries per unit) vs
    torch.linalg.vector_norm(g, dtype=float32) (no temporary), and clipping as it is done (an fp32 copy of a
    16-bit gradient, then mul_) - a kernel that took the clip coefficient as a gradient scale would do it in
    registers for free. Run after the rounds (it scales the gradients)."""
    gs = [g for g in eng.gshard if g.numel()]
    res: dict[str, list[float]] = {"norm_engine_s": [], "norm_vector_norm_s": [], "clip_engine_s": []}

    def clock(key: str, fn) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        res[key].append(time.perf_counter() - t0)

    def clip() -> None:
        for g in gs:
            (g.float() if g.dtype != torch.float32 else g).mul_(0.5)

    for _ in range(reps):
        clock("norm_engine_s", lambda: sum(float(g.float().pow(2).sum()) for g in gs))
        clock(
            "norm_vector_norm_s",
            lambda: sum(float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in gs),
        )
        clock("clip_engine_s", clip)
    return res


def timing_rank(rank: int, world: int, args: argparse.Namespace, precision: str) -> dict:
    # cores / ranks, explicitly (the harness starts ranks at 1 thread); the engine gives its CPU step the same.
    threads = max(1, args.cores // world)
    torch.set_num_threads(threads)
    # zoff calls all_gather_into_tensor, which torch 2.13 deprecates once per call site; it would drown the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    cfg0 = make_cfg(args, precision, "stage2")
    corpus = load_corpus(cfg0.data, cfg0.train.seed)
    batches = GlobalBatches(corpus, args.seq_len, args.batch, 1, rank, world, cfg0.train.seed)
    lr = cfg0.optim.lr  # constant: the schedule costs nothing and is not what is measured
    engines = {k: build_session(make_cfg(args, precision, k), torch.device("cpu")).engine for k in VARIANTS}
    accs = {k: instrument(e) for k, e in engines.items()}
    info = {
        k: {key: e.stats()[key] for key in ("cpu_adam", "cpu_step_threads", "params")}
        for k, e in engines.items()
    }
    step_no = 0

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal step_no
        step_no += 1
        return batches.micro_batch_at(step_no, 0)

    # DPU: past its synchronous warm-up, so that its timed steps are the steady state.
    for k, eng in engines.items():
        for _ in range(args.dpu_warmup + 1 if k == "dpu" else 1):
            run_step(eng, accs[k], *batch(), lr, args.grad_clip)
        eng.flush()
    rounds: list[dict[str, list[dict]]] = []
    n, spr = len(VARIANTS), args.steps_per_round
    for r in range(args.rounds):
        order = VARIANTS[r % n :] + VARIANTS[: r % n]
        rec = {}
        for k in order:
            eng = engines[k]
            dist.barrier()  # every variant's block starts with all ranks idle
            if k == "dpu":  # untimed lead-in: puts an update in flight for the first timed step to overlap
                run_step(eng, accs[k], *batch(), lr, args.grad_clip)
            rec[k] = [run_step(eng, accs[k], *batch(), lr, args.grad_clip) for _ in range(spr)]
            eng.flush()  # untimed: nothing runs on in the background during the next variant's block
        rounds.append(rec)
        if rank == 0:
            ms = "  ".join(f"{k} {1e3 * statistics.fmean(s['total'] for s in rec[k]):.0f}" for k in VARIANTS)
            print(f"  [{world} rank(s) {precision}] round {r + 1}/{args.rounds} ms/step: {ms}", flush=True)
    overhead = step_overhead_probe(engines["offload"], args.probe_reps)
    probe = copy_out_probe(engines["offload"], args.probe_reps) if precision != "fp32" else None
    return {
        "rounds": rounds,
        "info": info,
        "threads": threads,
        "copy_out_probe": probe,
        "step_overhead_probe": overhead,
    }


def mem_available() -> int:
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.startswith("MemAvailable:"):
            return int(ln.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="per-rank micro-batch (sequences)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--dpu-warmup", type=int, default=2, help="delay_update_warmup")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="train.grad_clip (the config default)")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="threads per rank = cores / ranks")
    ap.add_argument("--probe-reps", type=int, default=5, help="bf16 copy-out probe repetitions")
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown tables from --out's JSON")
    benchlib.native_precision_arg(ap)
    args = ap.parse_args(argv)
    if args.render:
        sys.exit(benchlib.print_rendered(args.out, render))
    worlds = [int(w) for w in args.worlds.split(",")]
    precisions = args.precisions.split(",")
    others = lambda p: ",".join(q for q in precisions if q != p) or "fp32"  # noqa: E731
    cpu = [  # every rank computes on the CPU
        benchlib.cpu_precision_plan(
            "bench_offload", p, args.native_precision, on_cpu=True, refuse=f"pass --precisions {others(p)}"
        )
        for p in precisions
    ]

    with torch.device("meta"):  # count parameters without allocating them
        psi = sum(p.numel() for p in build_model(make_cfg(args, "fp32", "stage2").model).parameters())
    result: dict = {
        **benchlib.provenance(),
        "command": benchlib.command_line(ap, args, "bench_offload"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "params": psi,
        "jobs": [],
    }
    slow = [c for c in cpu if c.matmul]  # (--native-precision: a 16-bit job on a slow kernel, on purpose)
    if slow:
        result["cpu_precision"] = slow[0].to_json()
    result["machine"]["cpu_adam"] = backend_info()  # builds/loads the kernel once, before the ranks start
    print(f"GPT {psi / 1e6:.1f}M params; CPU Adam: {result['machine']['cpu_adam']['reason']}", flush=True)
    for world in worlds:
        for precision in precisions:
            need = world * sum(state_bytes_per_param(precision, k, world) for k in VARIANTS) * psi
            avail = mem_available()
            print(
                f"job: {world} rank(s), {precision}, {max(1, args.cores // world)} thread(s)/rank; model state "
                f"~{need / GiB:.1f} GiB of {avail / GiB:.1f} GiB available",
                flush=True,
            )
            if need > 0.8 * avail:
                raise SystemExit("not enough memory for three variants: lower --layers/--d-model")
            per_rank = spawn(timing_rank, world, args, precision)
            result["jobs"].append({"world": world, "precision": precision, "summary": summarize(per_rank)})
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(result, indent=2) + "\n"
            )  # partial results survive a later failure
    print_table(result)
    print(f"wrote {args.out}")
    sys.stdout.write(render(result))


if __name__ == "__main__":
    main()
