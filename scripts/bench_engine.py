#!/usr/bin/env python
"""Benchmark zoff's ZeRO stages 0-3 against torch DDP and torch FSDP2 on CPU/gloo with 2 ranks.

Not a test. Every variant trains the same builtin GPT (built with the same seed) on the same batches, fp32,
AdamW with the same hyper-parameters and weight-decay groups, gradient clipping on (zoff computes the global
norm at every step anyway, so the torch variants clip too). Two measurements, each in fresh 2-rank jobs:

timing  ONE job keeps all six variants alive and interleaves rounds (A B C D E F, B C D E F A, ...), a few
        steps each after a warm-up. This host's memory bandwidth switches between modes ~1.7x apart and other
        work shares it, so only ratios within a round mean something: the table reports the median over rounds
        of per-round ratios, plus median ms/step (and its forward / backward / optimizer split) for scale.
memory  one job per variant, because ru_maxrss is monotonic within a process: peak RSS per rank, its growth
        over the post-import baseline, and the model-state bytes each variant holds, next to design.md §1's
        prediction for fp32 (params 4, grads 4, Adam m 4 + v 4 B/param; no separate master copy).
        Peak RSS includes what glibc keeps of freed memory; to see the live set instead, run with
        MALLOC_MMAP_THRESHOLD_=131072 (large blocks are then always mmapped and returned on free).

    python scripts/bench_engine.py [--layers 8] [--d-model 768] [--batch 1] [--rounds 11]
        [--steps-per-round 2] [--skip-memory] [--out docs/results/bench_engine.json]
    python scripts/bench_engine.py --render   # the markdown tables from the JSON (what the docs embed)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import benchlib
import torch
import torch.distributed as dist
from benchlib import gpt_config, print_targets, spawn
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from zoff.config import Config
from zoff.data import GlobalBatches, load_corpus
from zoff.engine.partition import default_decay
from zoff.models import build_model, lm_loss
from zoff.trainer.session import build_session

JSON = benchlib.RESULTS / "bench_engine.json"
WORLD = 2
VARIANTS = ("ddp", "zoff0", "zoff1", "zoff2", "zoff3", "fsdp2")
STAGE = {"ddp": 0, "zoff0": 0, "zoff1": 1, "zoff2": 2, "zoff3": 3, "fsdp2": 3}  # what each is compared as
MiB = 2**20


def predicted_bytes_per_param(stage: int, n: int) -> float:
    """design.md §1 for pure fp32 (param 4, grad 4, m 4, v 4; the param is its own master)."""
    return {0: 16.0, 1: 4 + 4 + 8 / n, 2: 4 + (4 + 8) / n, 3: 16 / n}[stage]


# ------------------------------------------------------------------------------------------ variants
def make_cfg(args: argparse.Namespace, stage: int = 0) -> Config:
    return gpt_config(args, {"stage": stage}, {"grad_clip": 1.0, "precision": "fp32", "seed": 0})


def make_batches(cfg: Config, rank: int, world: int) -> GlobalBatches:
    """The stream build_session gives a rank; shared by every variant so all see the same samples."""
    corpus = load_corpus(cfg.data, cfg.train.seed)
    return GlobalBatches(corpus, cfg.data.seq_len, cfg.data.batch_size, 1, rank, world, cfg.train.seed)


@dataclass
class Variant:
    model: nn.Module
    zero_grad: Callable[[], None]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    state_bytes: Callable[[], dict[str, int]]  # params / grads / optimizer_states this rank holds
    publish_s: Callable[[], float] = lambda: 0.0  # zoff 1/2: the parameter all-gather after the update


def zoff_variant(cfg: Config) -> Variant:
    eng = build_session(cfg, torch.device("cpu")).engine
    lr = cfg.optim.lr  # constant: the schedule costs nothing and is not what is measured
    publish = lambda: getattr(eng, "last_step_times", {}).get("publish_s", 0.0)  # noqa: E731
    return Variant(eng.model, eng.zero_grad, eng.backward, lambda: eng.step(lr), eng.memory_report, publish)


def torch_variant(cfg: Config, kind: str) -> Variant:
    torch.manual_seed(cfg.train.seed)  # build_session seeds the same way: identical initial weights
    model = build_model(cfg.model)
    if kind == "ddp":
        # Bucket views make DDP's gradients live in its all-reduce buckets: the honest 16 B/param baseline
        # (the default keeps a second 4 B/param copy, which would flatter every ZeRO stage).
        model = DDP(model, gradient_as_bucket_view=True)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if default_decay(n, p)]},
        {"params": [p for n, p in named if not default_decay(n, p)], "weight_decay": 0.0},
    ]
    o = cfg.optim
    # fused=True for both: the same kernel zoff's device-tier ShardOptimizer calls, so the comparison is not about Adam.
    opt = torch.optim.AdamW(
        groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True
    )

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()

    def state_bytes() -> dict[str, int]:
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
        params = list(model.parameters())
        states = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
        grads = [p.grad for p in params if p.grad is not None]
        return {"params": nbytes(params), "grads": nbytes(grads), "optimizer_states": nbytes(states)}

    return Variant(model, lambda: opt.zero_grad(set_to_none=True), torch.Tensor.backward, step, state_bytes)


def build_variant(name: str, args: argparse.Namespace) -> Variant:
    if name.startswith("zoff"):
        return zoff_variant(make_cfg(args, STAGE[name]))
    return torch_variant(make_cfg(args), name)


def run_step(v: Variant, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, float]:
    """One step; seconds in forward (with zero_grad), backward (with its reductions), optimizer step, and
    the part of the optimizer step that publishes parameters (zoff's all-gather; 0 for the others)."""
    t0 = time.perf_counter()
    v.zero_grad()
    loss = lm_loss(v.model(x), y)
    t1 = time.perf_counter()
    v.backward(loss)
    t2 = time.perf_counter()
    v.step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, v.publish_s()


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------- rank jobs
def setup_rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)  # cores / ranks, explicitly: oversubscription would distort both jobs
    # zoff calls all_gather_into_tensor, which torch 2.13 deprecates once per call site; it would drown the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def timing_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    setup_rank(args)
    batches = make_batches(make_cfg(args), rank, world)
    variants = {name: build_variant(name, args) for name in VARIANTS}
    for v in variants.values():
        for i in range(args.warmup):
            run_step(v, *batches.micro_batch_at(i, 0))
    rounds: list[dict[str, list[tuple[float, ...]]]] = []
    n, spr = len(VARIANTS), args.steps_per_round
    for r in range(args.rounds):
        # Rotating the start evens out any position effect (e.g. following the variant with the most traffic).
        order = VARIANTS[r % n :] + VARIANTS[: r % n]
        rec = {}
        for name in order:
            dist.barrier()  # every variant's block starts with both ranks idle
            first = args.warmup + r * spr  # the same batches for every variant in this round
            rec[name] = [run_step(variants[name], *batches.micro_batch_at(first + i, 0)) for i in range(spr)]
        rounds.append(rec)
        if rank == 0:
            ms = "  ".join(f"{k} {1e3 * sum(sum(s[:3]) for s in rec[k]) / spr:.0f}" for k in VARIANTS)
            print(f"  round {r + 1}/{args.rounds} ms/step: {ms}", flush=True)
    state = {name: v.state_bytes() for name, v in variants.items()}
    return {"rounds": rounds, "state_bytes": state, "peak_rss": max_rss()}


def memory_rank(rank: int, world: int, args: argparse.Namespace, name: str) -> dict:
    setup_rank(args)
    batches = make_batches(make_cfg(args), rank, world)
    baseline = max_rss()  # torch, zoff, the process group and the data are in; no model yet
    v = build_variant(name, args)
    built = max_rss()
    for i in range(args.mem_steps):  # torch's AdamW allocates m and v in its first step
        run_step(v, *batches.micro_batch_at(i, 0))
    return {"baseline": baseline, "after_build": built, "peak": max_rss(), "state_bytes": v.state_bytes()}


# --------------------------------------------------------------------------------------- reduction
def summarize_timing(per_rank: list[dict]) -> dict:
    n_rounds = len(per_rank[0]["rounds"])
    # A step ends when the slower rank ends: per round, the max over ranks of the mean step time.
    step = {
        k: [
            max(statistics.fmean(sum(s[:3]) for s in pr["rounds"][r][k]) for pr in per_rank)
            for r in range(n_rounds)
        ]
        for k in VARIANTS
    }
    parts = {}
    for k in VARIANTS:
        split = [
            [statistics.fmean(s[i] for pr in per_rank for s in pr["rounds"][r][k]) for r in range(n_rounds)]
            for i in range(4)
        ]
        names = ("fwd_ms", "bwd_ms", "opt_ms", "publish_ms")
        parts[k] = dict(zip(names, (1e3 * statistics.median(x) for x in split)))
    ratios = lambda a, b: [x / y for x, y in zip(step[a], step[b])]  # noqa: E731
    spread = lambda xs: statistics.quantiles(xs, n=4)[::2] if len(xs) > 1 else xs * 2  # noqa: E731  q1, q3
    return {
        "ms_per_step": {k: 1e3 * statistics.median(step[k]) for k in VARIANTS},
        "split": parts,
        "vs_ddp": {k: statistics.median(ratios(k, "ddp")) for k in VARIANTS},
        "vs_fsdp2": {k: statistics.median(ratios(k, "fsdp2")) for k in VARIANTS},
        # The spread of the per-round ratios (quartiles) says how far the medians can be trusted on a busy host.
        "vs_ddp_q1_q3": {k: spread(ratios(k, "ddp")) for k in VARIANTS},
        "vs_fsdp2_q1_q3": {k: spread(ratios(k, "fsdp2")) for k in VARIANTS},
        "per_round_ms": {k: [1e3 * t for t in step[k]] for k in VARIANTS},
        "state_bytes_rank0": per_rank[0]["state_bytes"],
    }


def summarize_memory(mem: dict[str, list[dict]], psi: int) -> dict:
    out = {}
    for k, ranks in mem.items():
        pred = predicted_bytes_per_param(STAGE[k], WORLD) * psi
        state = [sum(r["state_bytes"][c] for c in ("params", "grads", "optimizer_states")) for r in ranks]
        out[k] = {
            "peak_rss": [r["peak"] for r in ranks],
            "growth": [r["peak"] - r["baseline"] for r in ranks],
            "after_build_growth": [r["after_build"] - r["baseline"] for r in ranks],
            "model_state": state,
            "predicted_model_state": pred,
            "detail_rank0": ranks[0]["state_bytes"],
        }
    for k in out:  # saving vs DDP, rank by rank, and the saving design.md §1 predicts
        out[k]["saving_vs_ddp"] = [d - z for d, z in zip(out["ddp"]["peak_rss"], out[k]["peak_rss"])]
        out[k]["predicted_saving"] = out["ddp"]["predicted_model_state"] - out[k]["predicted_model_state"]
    return out


def targets(timing: dict | None, memory: dict | None) -> list[dict]:
    """The issue's targets; memory ones compare the worst rank's peak-RSS saving over DDP with §1's saving."""
    rows = []
    if timing:
        rows.append({"target": "zoff2 step time / DDP", "value": timing["vs_ddp"]["zoff2"], "limit": 1.10})
        rows.append(
            {"target": "zoff3 step time / FSDP2", "value": timing["vs_fsdp2"]["zoff3"], "limit": 1.00}
        )
    for row in rows:
        row["result"] = "PASS" if row["value"] <= row["limit"] else "MISS"
    for k in ("zoff0", "zoff1", "zoff2", "zoff3") if memory else ():
        got, want = min(memory[k]["saving_vs_ddp"]) / MiB, memory[k]["predicted_saving"] / MiB
        name = f"{k} peak RSS saved vs DDP, MiB (>= §1)"
        row = {
            "target": name,
            "value": got,
            "limit": want,
            "op": ">=",
            "result": "PASS" if got >= want else "MISS",
        }
        rows.append(row)
    return rows


def load() -> str:
    """Other work shares this host; its load average says how noisy the absolute times are."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def ratio_cell(t: dict, col: str, k: str) -> str:
    q1, q3 = t[f"{col}_q1_q3"][k]
    return f"{t[col][k]:.2f} ({q1:.2f}-{q3:.2f})"


def print_tables(result: dict) -> None:
    con = Console(width=max(120, Console().width))
    t, m, psi = result["timing"], result["memory"], result["params"]
    mc = result["machine"]
    con.print(
        f"[bold]zoff engine benchmark[/]: GPT {psi / 1e6:.1f}M params, fp32, {WORLD} ranks over gloo, "
        f"{result['args']['threads']} thread(s)/rank; {mc['cpu']}, {mc['cores']} cores, torch {mc['torch']}; "
        f"zoff {result['commit']}; load average (1/5/15 min) {result['loadavg_start']} at start, "
        f"{result['loadavg_end']} at end"
    )
    if t:
        tab = Table(
            title="ms per step and its parts (publish: zoff's parameter all-gather, inside opt), median over "
            "rounds; ratios: median (q1-q3) of per-round ratios"
        )
        for col in ("variant", "ms/step", "fwd", "bwd", "opt", "(publish)", "/ DDP", "/ FSDP2"):
            tab.add_column(col, justify="right")
        for k in VARIANTS:
            s = t["split"][k]
            ms = (t["ms_per_step"][k], s["fwd_ms"], s["bwd_ms"], s["opt_ms"], s["publish_ms"])
            tab.add_row(
                k,
                *(f"{x:.0f}" for x in ms),
                *(ratio_cell(t, c, k) for c in ("vs_ddp", "vs_fsdp2")),
            )
        con.print(tab)
    if m:
        tab = Table(title=f"memory per rank (MiB, rank0/rank1); §1 = design.md §1 fp32, Ψ={psi:,}, N={WORLD}")
        cols = "variant|model state|§1|peak RSS|growth|after build|saved vs DDP|§1 saved".split("|")
        for col in cols:
            tab.add_column(col, justify="right")
        mib = lambda xs: "/".join(f"{x / MiB:.0f}" for x in xs)  # noqa: E731
        for k in VARIANTS:
            mk = m[k]
            per_rank = ("model_state", "peak_rss", "growth", "after_build_growth", "saving_vs_ddp")
            cells = [mib(mk[c]) for c in per_rank]
            pred, saved = mk["predicted_model_state"] / MiB, mk["predicted_saving"] / MiB
            tab.add_row(k, cells[0], f"{pred:.0f}", *cells[1:], f"{saved:.0f}")
        con.print(tab)
    print_targets(con, "targets (issue 3)", result["targets"], digits=3)


LABEL = {
    "ddp": "DDP",
    "zoff0": "zoff 0",
    "zoff1": "zoff 1",
    "zoff2": "zoff 2",
    "zoff3": "zoff 3",
    "fsdp2": "FSDP2",
}


def render(data: dict) -> str:
    """The markdown tables the docs embed: ratios per variant, memory per rank, the targets; pure."""
    t, m, a = data["timing"], data["memory"], data["args"]
    out = [
        f"{data['params'] / 1e6:.1f}M-parameter GPT ({a['layers']} layers x {a['d_model']}, {a['seq_len']} tokens, "
        f"micro-batch {a['batch']}), fp32, {WORLD} ranks x {a['threads']} thread(s) over gloo, {a['rounds']} "
        f"interleaved rounds of {a['steps_per_round']} steps; ratios are medians of per-round ratios (q1-q3). "
        "DDP with bucket views and fused AdamW, FSDP2 `fully_shard` per block with fused AdamW.\n\n"
    ]
    rows = []
    if t:
        rows.append(["ms per step (median, for scale)", *(f"{t['ms_per_step'][k]:.0f}" for k in VARIANTS)])
        for col, base in (("vs_ddp", "ddp"), ("vs_fsdp2", "fsdp2")):
            cells = ["1.00" if k == base else ratio_cell(t, col, k) for k in VARIANTS]
            rows.append([f"step time / {LABEL[base]}", *cells])
    if m:
        mib = lambda xs: "/".join(f"{x / MiB:.0f}" for x in xs)  # noqa: E731
        rows.append(
            ["model-state MiB per rank (rank 0/rank 1)", *(mib(m[k]["model_state"]) for k in VARIANTS)]
        )
        pred = (f"{m[k]['predicted_model_state'] / MiB:.0f}" for k in VARIANTS)
        rows.append(["model-state MiB per rank, design.md §1 (fp32)", *pred])
        rows.append(["peak RSS MiB per rank (rank 0/rank 1)", *(mib(m[k]["peak_rss"]) for k in VARIANTS)])
        saved = [
            ""
            if k == "ddp"
            else f"{min(m[k]['saving_vs_ddp']) / MiB:.0f} / {m[k]['predicted_saving'] / MiB:.0f}"
            for k in VARIANTS
        ]
        rows.append(["RSS saved vs DDP, worse rank / §1's predicted saving (MiB)", *saved])
    out.append(benchlib.md_table(["", *(LABEL[k] for k in VARIANTS)], rows))
    out += [
        "\n",
        benchlib.md_targets(data["targets"], digits=2),
        "\n",
        benchlib.measured_line(data, "bench_engine"),
    ]
    return "".join(out)


# --------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="per-rank micro-batch (sequences)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="steps per variant before the timed rounds")
    ap.add_argument("--mem-steps", type=int, default=3, help="steps per variant in each memory job")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // WORLD), help="per rank")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown tables from --out's JSON")
    args = ap.parse_args()
    if args.render:
        sys.exit(benchlib.print_rendered(args.out, render))

    with torch.device("meta"):  # count parameters without allocating them
        psi = sum(p.numel() for p in build_model(make_cfg(args).model).parameters())
    est = sum(predicted_bytes_per_param(STAGE[k], WORLD) for k in VARIANTS) * psi
    print(
        f"GPT {psi / 1e6:.1f}M params; timing job holds ~{est / 2**30:.1f} GiB of model state per rank",
        flush=True,
    )
    if est > 8 * 2**30:
        raise SystemExit("model too large: six variants must fit in ~8 GB per rank; lower --layers/--d-model")

    result: dict = {
        **benchlib.provenance(),
        "command": benchlib.command_line(ap, args, "bench_engine"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "params": psi,
        "loadavg_start": load(),
    }
    result["timing"] = result["memory"] = None
    if not args.skip_timing:
        print(f"timing: {len(VARIANTS)} variants in one {WORLD}-rank job, {args.rounds} rounds", flush=True)
        result["timing"] = summarize_timing(spawn(timing_rank, WORLD, args))
    if not args.skip_memory:
        mem = {}
        for k in VARIANTS:
            print(f"memory: {k} in a fresh {WORLD}-rank job", flush=True)
            mem[k] = spawn(memory_rank, WORLD, args, k)
        result["memory"] = summarize_memory(mem, psi)
    result["loadavg_end"] = load()
    result["targets"] = targets(result["timing"], result["memory"])
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    sys.stdout.write(render(result))


if __name__ == "__main__":
    main()
