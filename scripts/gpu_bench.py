#!/usr/bin/env python
"""zoff's offload policies beside torch's FSDP2 with CPUOffloadPolicy on one CUDA GPU (issue 54).

    python scripts/gpu_bench.py --dry-run      # what a GPU run would do and its time bound; runs nothing
    python scripts/gpu_bench.py                # on one CUDA GPU, at most --total-s (420 s) for the whole call
    python scripts/gpu_bench.py --cpu-smoke    # the same code at tiny size: 2 ranks over gloo, fp32
    python scripts/gpu_bench.py --render

The model: the builtin GPT, 30 layers x 3072 (24 heads), vocabulary 256: 3.41B parameters (configs/
gpt-3b-nvme.yaml's shape), bf16, 8 sequences of 2048 tokens a step, activation checkpointing, synthetic data,
grad_clip 1.0, AdamW at a constant lr 1e-4. Variants (--variants): zoff's zero2 (no offload: the upper
bound), zero2-offload, zero3-offload and zero3-nvme (overlap_step on, stage 3 only), each offload policy
with speculate false and true (+spec), and zero3-offload once more with the forward waiting for every upload
queued so far instead of its unit's (+wait-all: overlap.PER_UNIT_UPLOAD_WAIT off, the wait before issue 54); FSDP2 (fully_shard per block and at the root, CPUOffloadPolicy, bf16
params with fp32 reduction, torch.optim.AdamW as constructed by default, NCCL with gloo beside it:
--fsdp2-backend) from the same initial weights, batches and clip (clip_grad_norm_; where it raises, FSDP2
trains unclipped and the row says so).

Each variant is a fresh process with a time budget (the call's time left, shared by the variants still to
run): steps until the budget nears its end, the second under torch's profiler (its CUDA memcpy bytes: PCIe).
docs/gpus.md ("The GPU benchmark") describes the metrics and the device-time plan.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from zoff.config import config_from_dict
from zoff.data import GlobalBatches, load_corpus
from zoff.engine.partition import default_decay
from zoff.engine.step import overlap
from zoff.models import build_model, enable_activation_checkpointing, meta_model, model_flops_per_token
from zoff.planning.disk_room import check_swap_path
from zoff.trainer.loss import forward_loss
from zoff.trainer.metrics import peak_flops
from zoff.trainer.session import build_session

JSON = benchlib.RESULTS / "gpu_bench.json"
SMOKE_JSON = benchlib.REPO / "runs" / "gpu_bench_cpu_smoke.json"
TOTAL_S, RESERVE_S = 420.0, 25.0  # the call's bound; what the parent's start, the render and the kills keep
ALL = ("zero2", "zero2-offload", "zero2-offload+spec", "zero3-offload", "zero3-offload+spec",
       "zero3-offload+wait-all", "zero3-nvme", "zero3-nvme+spec", "fsdp2-offload")  # fmt: skip


def zero_section(name: str, nvme: str) -> dict:
    """zoff's zero section of a variant: its recipe, overlap_step on stage 3's offload, speculate off or on."""
    policy, spec = name.partition("+")[0], name.endswith("+spec")
    if policy == "zero2":
        return {"recipe": "zero2"}
    oo: dict = {"speculate": spec, "overlap_step": policy.startswith("zero3")}
    if policy != "zero3-nvme":
        return {"recipe": policy, "offload_optimizer": oo}
    at = {"nvme_path": nvme}
    return {"recipe": policy, "offload_optimizer": oo | at, "offload_param": at}


def config_dict(a: argparse.Namespace, zero: dict) -> dict:
    heads = max(1, a.d_model // 128) if a.d_model >= 512 else 2
    return {
        "model": {"name": "gpt", "n_layer": a.layers, "n_head": heads, "d_model": a.d_model,
                  "seq_len": a.seq_len, "vocab_size": 256},
        "data": {"name": "synthetic", "seq_len": a.seq_len, "batch_size": a.batch,
                 "synthetic_tokens": 40 * (a.seq_len + 1)},  # (made by a Python loop: kept short)
        "zero": zero,
        "optim": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"warmup_steps": 0, "decay": "constant"},
        "train": {"precision": a.precision, "grad_clip": a.grad_clip, "max_steps": a.steps,
                  "activation_checkpointing": True, "seed": 0},
    }  # fmt: skip


def _all(value: float, device: torch.device, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t)


def one_step(step: int, job: dict, device: torch.device, fwd_bwd, opt_step) -> dict:
    """One training step: forward+backward between two marks, then the optimizer; the mean loss over ranks."""
    cuda = device.type == "cuda"  # (CUDA events on the compute stream there, the host's clock on a CPU)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
    if cuda:
        torch.cuda.synchronize(device)
        marks[0].record()
    t0 = time.perf_counter()
    local = fwd_bwd(step, job["lr"])
    t1 = time.perf_counter()
    if cuda:
        marks[1].record()
    extra = opt_step(step, job["lr"])
    loss = _all(float(local), device) / dist.get_world_size()  # (waits for the device)
    if cuda:
        torch.cuda.synchronize(device)
    fwd_bwd_s = marks[0].elapsed_time(marks[1]) / 1e3 if cuda else t1 - t0
    return {"step_s": time.perf_counter() - t0, "fwd_bwd_s": fwd_bwd_s, "loss": loss, **extra}


def profiled_step(step: int, job: dict, device: torch.device, fwd_bwd, opt_step) -> tuple[dict, dict | None]:
    """One more step under torch's profiler: its row, and the bytes of the trace's CUDA memcpy events by
    direction (None on the CPU)."""
    acts = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[acts.CUDA if device.type == "cuda" else acts.CPU]) as prof:
        row = one_step(step, job, device, fwd_bwd, opt_step)
    with tempfile.TemporaryDirectory() as d:
        try:
            prof.export_chrome_trace(f"{d}/trace.json")
            events = json.loads(Path(f"{d}/trace.json").read_text()).get("traceEvents", [])
        except (OSError, ValueError) as e:
            return row, {"error": f"{type(e).__name__}: {e}"[:200]}
    if device.type != "cuda":
        return row, None
    if not any(e.get("cat") == "kernel" for e in events):  # (no zeros where CUPTI recorded nothing)
        return row, {"error": "the trace holds no CUDA kernel: the profiler saw no device activity"}
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    moved = lambda way: sum(e.get("args", {}).get("bytes", 0) for e in copies if way in e.get("name", ""))  # noqa: E731
    secs = sum(e.get("dur", 0) for e in copies) / 1e6
    return row, {"h2d_bytes": moved("HtoD"), "d2h_bytes": moved("DtoH"), "copy_s": secs}


def measure(job: dict, device: torch.device, fwd_bwd, opt_step) -> dict:
    """Steps until the job's budget nears its end (at least job["min_steps"], at most job["steps"]), the second
    under torch's profiler (its PCIe bytes; left out of the timings); every rank agrees on each decision.
    Rank 0 saves the rows after each step: a run stopped at its budget still reports the steps it made."""
    rows, step, deadline = [], 0, job["deadline"]

    def keep(row: dict) -> None:
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rows.append(row)
        if dist.get_rank() == 0:
            _save({"rows": rows, "peak_flops": job["peak_flops"]}, job["partial"])

    while True:
        if step == 1:
            row, pcie = profiled_step(step, job, device, fwd_bwd, opt_step)
            keep({**row, "profiled": True, "pcie": pcie})
        else:
            keep(one_step(step, job, device, fwd_bwd, opt_step))
        step += 1
        est = max(r["step_s"] for r in rows[-2:])
        more = step < job["steps"] and (step < job["min_steps"] or time.monotonic() + 3 * est < deadline)
        if not _all(float(more), device, dist.ReduceOp.MIN):
            return summary(rows, job, job["peak_flops"])


def summary(rows: list[dict], job: dict, peak: float | None) -> dict:
    """A variant's figures from its steps' rows: the medians of steps 3..N-1 (the first warms up, the second
    is profiled)."""
    timed = [r for r in rows[1:] if not r.get("profiled")] or rows
    timed = timed[:-1] if len(timed) > 1 else timed  # an overlapped step's walk ends after the last
    step_s = statistics.median(r["step_s"] for r in timed)
    tok_s = job["tokens_per_step"] / step_s
    pcie = next((r["pcie"] for r in rows if r.get("profiled")), None)
    if pcie and "h2d_bytes" in pcie:
        pcie["gbps"] = (pcie["h2d_bytes"] + pcie["d2h_bytes"]) / step_s / 1e9
    out = {"status": "ok", "steps": len(rows), "timed_steps": len(timed), "step_s": step_s, "tok_s": tok_s,
           "mfu": job["flops_per_token"] * tok_s / (peak * job["world"]) if peak else None,
           "gpu_busy": statistics.median(r["fwd_bwd_s"] / r["step_s"] for r in timed),
           "optimizer_s": statistics.median(r["optimizer_s"] for r in timed), "pcie": pcie,
           "losses": [r["loss"] for r in rows], "step_times_s": [r["step_s"] for r in rows],
           "peak_gpu_bytes": rows[-1]["peak_gpu_bytes"], "peak_rss_bytes": rows[-1]["peak_rss_bytes"]}  # fmt: skip
    keys = ("spec_committed_units", "spec_speculated_units", "disk_read_bytes", "disk_written_bytes", "clip")
    return out | {k: [r.get(k) for r in rows] for k in keys if any(k in r for r in rows)}


def zoff_job(job: dict, device: torch.device) -> dict:
    """zoff through its public pieces (trainer/loop.py's step): build_session, the engine's backward and step."""
    cfg = config_from_dict(job["cfg"])
    overlap.PER_UNIT_UPLOAD_WAIT = not job["name"].endswith("+wait-all")  # (set per job: one spawn runs many)
    s = build_session(cfg, device)
    e, accum = s.engine, s.batches.grad_accum

    def fwd_bwd(step: int, lr: float) -> torch.Tensor:
        e.model.train()
        e.zero_grad()
        local = torch.zeros((), dtype=torch.float64, device=e.device)
        for micro in range(accum):
            loss = forward_loss(e.model, s.batches.micro_batch_at(step, micro), accum, e.device, 0)
            e.backward(loss, sync=micro == accum - 1, lr=lr)
            local += loss.detach()
        return local

    def opt_step(step: int, lr: float) -> dict:
        e.step(lr)
        t = e.last_step_times
        disk = lambda kind: sum(v for k, v in t.items() if k.startswith("disk_") and k.endswith(kind))  # noqa: E731
        return {"optimizer_s": t.get("last_walk_s") or t.get("optimizer_s", 0.0),
                "spec_committed_units": t.get("spec_committed_units", 0),
                "spec_speculated_units": t.get("spec_speculated_units", 0),
                "disk_read_bytes": disk("_read_bytes"), "disk_written_bytes": disk("_written_bytes")}  # fmt: skip

    try:
        out = measure(job, device, fwd_bwd, opt_step)
    except BaseException:
        with contextlib.suppress(Exception):  # (the row reports the first error, not the close's)
            e.close()
        raise
    e.flush()
    e.close()
    return out


def fsdp2_job(job: dict, device: torch.device) -> dict:
    """torch's FSDP2 with CPUOffloadPolicy and torch's AdamW, on zoff's model, init, batches and clip."""
    cfg, world = config_from_dict(job["cfg"]), dist.get_world_size()
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)  # fp32 on the host: zoff's initial weights (its GPT's per-name init)
    enable_activation_checkpointing(model)
    kw: dict = {"mesh": init_device_mesh(device.type, (world,)),
                "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}  # fmt: skip
    if cfg.train.precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    named, o = list(model.named_parameters()), cfg.optim
    groups = [{"params": [p for n, p in named if default_decay(n, p)]},
              {"params": [p for n, p in named if not default_decay(n, p)], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    corpus = load_corpus(cfg.data, cfg.train.seed)
    rank, accum = dist.get_rank(), cfg.train.grad_accum
    batches = GlobalBatches(corpus, cfg.data.seq_len, cfg.data.batch_size, accum, rank, world, cfg.train.seed)
    clip = {"error": None}

    def fwd_bwd(step: int, lr: float) -> torch.Tensor:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(accum):
            loss = forward_loss(model, batches.micro_batch_at(step, micro), accum, device, 0)
            loss.backward()
            local += loss.detach()
        return local

    def opt_step(step: int, lr: float) -> dict:
        t0 = time.perf_counter()
        if cfg.train.grad_clip > 0 and clip["error"] is None:
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            except Exception as e:  # pytorch #148532: under CPU offload on NCCL; then it trains unclipped
                clip["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:240]
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"optimizer_s": time.perf_counter() - t0, "clip": clip["error"] or "ok"}

    return measure(job, device, fwd_bwd, opt_step)


def _save(obj: object, path: str) -> None:
    """torch.save, whole or not at all: a run stopped at its budget may be stopped while writing."""
    torch.save(obj, path + ".part")
    os.replace(path + ".part", path)


def _entry(rank: int, world: int, port: int, backend: str, jobs: list[dict], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # zoff train's threads_per_rank default
    device = torch.device("cuda", rank) if "nccl" in backend else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    results = []
    try:
        for i, job in enumerate(jobs):
            t0 = time.monotonic()
            job = {**job, "deadline": t0 + job["budget_s"] - job["tail_s"], "partial": f"{out}/partial{i}.pt",
                   "peak_flops": peak_flops(device, job["precision"])}  # fmt: skip
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                r = (fsdp2_job if job["kind"] == "fsdp2" else zoff_job)(job, device)
            except Exception as e:  # (an out-of-memory variant, a refused config: the row says so)
                r = {"status": f"failed: {type(e).__name__}: {e}".splitlines()[0][:300]}
            results.append({"name": job["name"], "round": job["round"], "wall_s": time.monotonic() - t0, **r})
            _save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(jobs: list[dict], world: int, backend: str, timeout_s: float) -> list[dict]:
    """Rank 0's result of each job, run one after the other in `world` fresh processes; a job with no result
    (the processes stopped at timeout_s, or crashed) gets a status saying so."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s, tempfile.TemporaryDirectory() as out:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        procs = [ctx.Process(target=_entry, args=(r, world, port, backend, jobs, out)) for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        late = [p for p in procs if p.is_alive()]
        for p in late:
            p.kill()
            p.join()
        f = Path(out) / "rank0.pt"
        got = torch.load(f, weights_only=False) if f.exists() else []
        why = f"stopped at its budget ({timeout_s:.0f} s)" if late else f"exit code {procs[0].exitcode}"
        for i, j in enumerate(jobs[len(got) :], start=len(got)):
            got.append({"name": j["name"], "round": j["round"], "status": f"no result: {why}"})
            part = Path(out) / f"partial{i}.pt"
            rows = torch.load(part, weights_only=False) if part.exists() else {"rows": []}
            if len(rows["rows"]) >= 3:  # the steps it made: their figures, marked
                got[-1] |= summary(rows["rows"], j, rows["peak_flops"]) | {"status": "ok", "note": why}
    return got


def plan(a: argparse.Namespace) -> dict:
    """What the call runs: world, backend, the jobs (variants x rounds, each round in reverse order of the last),
    and the variants left out (zero3-nvme where zoff's own check finds too little room on --nvme-dir)."""
    nvme = str(Path(a.nvme_dir) / "swap")
    c = config_from_dict(config_dict(a, {"recipe": "zero2"}))
    m = meta_model(c.model)  # (no memory) its parameters, tied ones once, and training FLOPs per token
    params = sum(t.numel() for t in set(m.parameters()))
    flops = model_flops_per_token(m, c.model, c.data.seq_len)
    names = [n for n in ALL if n in a.variants.split(",")]
    skipped, jobs = {}, []
    for n in (n for n in names if n.startswith("zero3-nvme")):
        cfg = config_from_dict(config_dict(a, zero_section(n, nvme)))
        try:  # zoff's own plan of its swap files against the folder's room (UserError), host_budget's RAM out
            check_swap_path(cfg, meta_model(cfg.model)) if Path(nvme).is_dir() else None
        except Exception as e:
            skipped[n] = f"skipped: {e}".splitlines()[0]
    for r in range(a.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            if n not in skipped:
                cfg = config_dict(a, {} if n == "fsdp2-offload" else zero_section(n, nvme))
                jobs.append({"name": n, "round": r + 1, "kind": "fsdp2" if n.startswith("fsdp2") else "zoff",
                             "cfg": cfg, "lr": 1e-4, "steps": a.steps, "min_steps": min(a.steps, 5),
                             "tail_s": a.tail_s, "precision": a.precision,
                             "world": a.world, "tokens_per_step": a.batch * a.seq_len * a.world,
                             "flops_per_token": flops})  # fmt: skip
    return {"world": a.world, "backend": "gloo" if a.cpu_smoke else "nccl", "params": params,
            "flops_per_token": flops, "names": names, "skipped": skipped, "jobs": jobs, "nvme": nvme}  # fmt: skip


def run_jobs(a: argparse.Namespace, p: dict) -> list[dict]:
    """Every job within the call's bound: on a GPU one process per job, each with the time left shared by the
    jobs still to run; --cpu-smoke all in one spawn."""
    end = time.monotonic() + a.total_s - RESERVE_S
    if a.cpu_smoke:
        jobs = [{**j, "budget_s": (end - time.monotonic()) / len(p["jobs"])} for j in p["jobs"]]
        return spawn(jobs, p["world"], p["backend"], end - time.monotonic())
    out = []
    for i, j in enumerate(p["jobs"]):
        if j["name"].startswith("zero3-nvme"):  # an empty swap folder: a stopped run leaves its files
            shutil.rmtree(p["nvme"], ignore_errors=True)
            Path(p["nvme"]).mkdir(parents=True)
        budget = (end - time.monotonic()) / (len(p["jobs"]) - i)
        print(f"gpu_bench: {j['name']} (round {j['round']}), budget {budget:.0f} s", flush=True)
        backend = a.fsdp2_backend if j["kind"] == "fsdp2" else p["backend"]
        out += spawn([{**j, "budget_s": budget}], p["world"], backend, budget)
    shutil.rmtree(p["nvme"], ignore_errors=True)
    return out


def merged(results: list[dict], names: list[str], skipped: dict) -> list[dict]:
    """One row per variant: its rounds' medians (the losses and counts of its first good round)."""
    rows = []
    for n in names:
        runs = [r for r in results if r["name"] == n]
        ok = [r for r in runs if r.get("status") == "ok"]
        if not ok:
            rows.append({"name": n, "status": skipped.get(n) or (runs[0]["status"] if runs else "not run")})
            continue
        keys = [k for k in ("step_s", "tok_s", "mfu", "gpu_busy", "optimizer_s") if ok[0].get(k) is not None]
        rows.append({**ok[0], "rounds": len(ok), **{k: statistics.median(r[k] for r in ok) for k in keys}})
    return rows


def loss_check(rows: list[dict], precision: str) -> dict:
    """zoff's losses against FSDP2's over the steps both ran (step 1 only where FSDP2's clip failed), and the
    zoff variants' spread among themselves."""
    zoff = [r for r in rows if r.get("status") == "ok" and not r["name"].startswith("fsdp2")]
    fsdp = next((r for r in rows if r.get("status") == "ok" and r["name"].startswith("fsdp2")), None)
    tol = 1e-4 if precision == "fp32" else 2e-2  # relative: fp32's rounding, bf16's
    out: dict = {"tolerance": tol, "steps": 0, "vs_fsdp2": None, "zoff_spread": None}
    if not zoff:
        return out | {"ok": None}
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    n = min(len(r["losses"]) for r in zoff)
    first = zoff[0]["losses"]
    out["zoff_spread"] = max(rel(x, y) for r in zoff for x, y in zip(r["losses"][:n], first))
    if fsdp is not None:
        clipped = set(fsdp.get("clip", ["ok"])) == {"ok"}
        n = min(n, len(fsdp["losses"])) if clipped else 1
        out["vs_fsdp2"] = max(rel(x, y) for r in zoff for x, y in zip(r["losses"][:n], fsdp["losses"][:n]))
        out["fsdp2_clip"] = "ok" if clipped else next(c for c in fsdp["clip"] if c != "ok")
    out["steps"] = n
    worst = max(v for v in (out["vs_fsdp2"], out["zoff_spread"]) if v is not None)
    return out | {"ok": worst <= out["tolerance"]}


def _f(v, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def _row(r: dict) -> str:
    if r.get("status") != "ok":
        return f"| {r['name']} | {r['status']} |" + " |" * 11
    pcie = r.get("pcie") or {}
    moved = f"{pcie['h2d_bytes'] / 1e9:.1f} / {pcie['d2h_bytes'] / 1e9:.1f}" if "h2d_bytes" in pcie else "-"
    spec, notes = r.get("spec_speculated_units"), [f"{r['note']}: the steps it made" if "note" in r else ""]
    if spec and any(spec):
        notes.append(f"units committed {sum(r['spec_committed_units'])} of {sum(spec)}")
    if any(r.get("disk_read_bytes") or []):
        notes.append(f"disk {max(r['disk_read_bytes']) / 1e9:.1f} GB read a step")
    if set(r.get("clip") or ["ok"]) != {"ok"}:
        notes.append("clip_grad_norm_ failed: trained unclipped")
    if "error" in pcie:
        notes.append(f"PCIe not measured: {pcie['error']}")
    note = "; ".join(n for n in notes if n)
    return (f"| {r['name']} | {r['steps']} ({r['timed_steps']} timed) | {r['step_s']:.3f} | {r['tok_s']:,.0f} "
            f"| {_f(r['mfu'], '.1%')} | {r['gpu_busy']:.2f} | {r['optimizer_s']:.3f} | {moved} "
            f"| {_f(pcie.get('gbps'), '.1f')} | {_f(r['peak_gpu_bytes'], '.1f', 2**-30)} "
            f"| {r['peak_rss_bytes'] / 2**30:.1f} | {r['losses'][-1]:.4f} | {note} |")  # fmt: skip


def render(data: dict) -> str:
    m, lc, rows = data["model"], data["loss_check"], data["variants"]
    by = {r["name"]: r for r in rows if r.get("status") == "ok"}
    ratio = ""
    if "zero3-offload" in by and "fsdp2-offload" in by:
        x = by["zero3-offload"]["tok_s"] / by["fsdp2-offload"]["tok_s"]
        ratio = f"zoff zero3-offload / FSDP2 with CPU offload, tok/s: **{x:.2f}x** (the goal: 1.5x). "
    verdict = {True: "within", False: "**outside**", None: "not compared:"}[lc["ok"]]
    each = "each variant a fresh process" if data["mode"] == "GPU" else "the variants in one spawn"
    clip = f" FSDP2's clip_grad_norm_ failed ({lc['fsdp2_clip']}): compared at step 1 only." if lc.get(
        "fsdp2_clip", "ok") != "ok" else ""  # fmt: skip
    return "\n".join([
        f"{data['mode']}: builtin GPT {m['layers']} x {m['d_model']} ({m['params'] / 1e9:.2f}B parameters), "
        f"{m['precision']}, {m['batch']} x {m['seq_len']} tokens a step on {data['world']} rank(s), activation "
        f"checkpointing, grad_clip {m['grad_clip']:g}; {data['device']}, FSDP2's process group "
        f"{data.get('fsdp2_backend', '-')}; {each} within "
        f"{data['total_s']:.0f} s for the call, {data['rounds']} round(s); step = median of steps 3..N-1 "
        "(step 1 warms up, step 2 runs under the profiler for the PCIe bytes).",
        "",
        "| variant | steps | step, s | tok/s | MFU | GPU busy | host optimizer, s | PCIe GB a step (H2D / D2H) "
        "| PCIe GB/s | peak GPU, GiB | peak RSS, GiB | last loss | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *[_row(r) for r in rows],
        "",
        f"{ratio}Losses over {lc['steps']} step(s): zoff against FSDP2 {_f(lc['vs_fsdp2'], '.2e')}, zoff's variants "
        f"among themselves {_f(lc['zoff_spread'], '.2e')} (relative), {verdict} {lc['tolerance']:g}.{clip}",
        "",
        benchlib.measured_line(data, "gpu_bench"),
    ])  # fmt: skip


def gpu_check_status() -> str:
    """Whether scripts/gpu_check.sh must run before this in a GPU session: its last recorded pass
    (docs/results/gpu_check.json) and whether zoff/ changed since that commit (git, on this checkout)."""
    try:
        last = json.loads((benchlib.RESULTS / "gpu_check.json").read_text())
        commit = last["header"].rpartition("commit ")[2].split()[0]
    except (OSError, ValueError, KeyError, IndexError):
        return "no recorded gpu_check.sh run: run it first"
    diff = subprocess.run(["git", "diff", "--stat", commit, "HEAD", "--", "zoff/"], cwd=benchlib.REPO,
                          capture_output=True, text=True)  # fmt: skip
    said = "passed" if last.get("passed") else "FAILED"
    if diff.returncode != 0:
        return f"{said} at {commit}; git cannot compare it with this checkout: run it first"
    changed = diff.stdout.strip().splitlines()[-1].strip() if diff.stdout.strip() else "none"
    if changed != "none" or not last.get("passed"):
        return f"{said} at {commit}; zoff/ changed since ({changed}): run it first"
    return f"passed at {commit} and zoff/ is unchanged since: skip it, run this script alone"


def dry_run(a: argparse.Namespace, p: dict) -> str:
    n = len(p["jobs"])
    lines = [
        f"gpu_bench --dry-run: on one CUDA GPU, world {p['world']} over {p['backend']} (FSDP2: "
        f"{a.fsdp2_backend}); runs nothing",
        f"model: builtin GPT {a.layers} x {a.d_model}, {p['params'] / 1e9:.2f}B parameters, {a.precision}, "
        f"{a.batch} x {a.seq_len} tokens a step, activation checkpointing, grad_clip {a.grad_clip:g}",
        f"time bound: {a.total_s:.0f} s for the whole call; {RESERVE_S:.0f} s kept for start and render, "
        f"{n} variant run(s) of ~{(a.total_s - RESERVE_S) / max(n, 1):.0f} s each (the time left shared by "
        f"the runs still to go; a run past its budget is stopped), at most {a.steps} steps each, "
        f"{a.rounds} round(s)",
        f"results: {a.out}",
        f"scripts/gpu_check.sh: {gpu_check_status()}",
    ]
    for j in p["jobs"]:
        z = j["cfg"]["zero"]
        what = (
            json.dumps(z)
            if z
            else f"FSDP2 fully_shard + CPUOffloadPolicy, torch.optim.AdamW, {a.fsdp2_backend}"
        )
        lines.append(f"  {j['name']:<20} round {j['round']}: {what}")
    lines += [f"  {n:<20} {why}" for n, why in p["skipped"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print what a GPU run would do and its bound")
    ap.add_argument("--cpu-smoke", action="store_true", help="the same code, tiny, 2 ranks over gloo, fp32")
    for flag, default, what in (("--layers", 30, "GPT layers"), ("--d-model", 3072, "GPT width"),
                                ("--seq-len", 2048, "tokens a sequence"), ("--batch", 8, "sequences a step"),
                                ("--steps", 12, "at most this many steps a variant"),
                                ("--rounds", 1, "2: the variants again, in reverse order")):  # fmt: skip
        ap.add_argument(flag, type=int, default=default, help=what)
    ap.add_argument("--total-s", type=float, default=TOTAL_S, help="the whole call's bound, seconds")
    ap.add_argument("--tail-s", type=float, default=15.0, help="a run's last seconds kept for its end")
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--variants", default=",".join(ALL), help=f"comma-separated, of {','.join(ALL)}")
    ap.add_argument("--nvme-dir", default="/var/tmp/zoff-gpu-bench", help="zero3-nvme's swap files")
    ap.add_argument("--fsdp2-backend", default="cuda:nccl,cpu:gloo", choices=["cuda:nccl,cpu:gloo", "nccl"],
                    help="FSDP2's process group on the GPU: torch's FSDP2 example's with CPU offload (gloo "
                    "reduces its host-side norms), or NCCL alone, where clip_grad_norm_ raises (pytorch #148532)")  # fmt: skip
    benchlib.output_args(ap, JSON)
    a = ap.parse_args(argv)
    if set(a.variants.split(",")) - set(ALL):
        ap.error(
            f"--variants: unknown {', '.join(sorted(set(a.variants.split(',')) - set(ALL)))}; of {', '.join(ALL)}"
        )
    if a.render:
        return benchlib.print_rendered(a.out, render)
    cmd, a.precision, a.world = benchlib.command_line(ap, a, "gpu_bench"), "bf16", 1
    if a.cpu_smoke:  # tiny, fp32 (no fast bf16 kernels on most CPUs), 2 ranks: the same code path
        a.layers, a.d_model, a.seq_len, a.batch, a.steps, a.precision, a.world = 2, 64, 32, 2, 5, "fp32", 2
        a.out = SMOKE_JSON if a.out == JSON else a.out
    elif not a.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; --dry-run shows what it would run, --cpu-smoke runs it tiny "
              "on the CPU", file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        if a.cpu_smoke and a.nvme_dir == ap.get_default("nvme_dir"):
            a.nvme_dir = tmp
        if not a.dry_run:
            (Path(a.nvme_dir) / "swap").mkdir(parents=True, exist_ok=True)
        p = plan(a)
        if a.dry_run:
            sys.stdout.write(dry_run(a, p))
            return 0
        t0 = time.monotonic()
        rows = merged(run_jobs(a, p), p["names"], p["skipped"])
    device = "CPU (gloo): FSDP2's offload moves nothing" if a.cpu_smoke else torch.cuda.get_device_name(0)
    data = {**benchlib.provenance(), "command": cmd, "device": device, "world": p["world"],
            "fsdp2_backend": "gloo" if a.cpu_smoke else a.fsdp2_backend,
            "mode": "CPU smoke (fp32, not bf16: bf16 matmuls are ~100x slower on a CPU without AVX512)"
            if a.cpu_smoke else "GPU", "rounds": a.rounds, "total_s": a.total_s, "wall_s": time.monotonic() - t0,
            "model": {"layers": a.layers, "d_model": a.d_model, "seq_len": a.seq_len, "batch": a.batch,
                      "params": p["params"], "flops_per_token": p["flops_per_token"], "precision": a.precision,
                      "grad_clip": a.grad_clip},
            "variants": rows, "loss_check": loss_check(rows, a.precision)}  # fmt: skip
    if not a.cpu_smoke:
        data["machine"]["gpu"] = f"GPU: {device}"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    return benchlib.write_result(a.out, data, render)


if __name__ == "__main__":
    sys.exit(main())
