#!/usr/bin/env python
"""Benchmark zoff's sharded checkpoints against torch.save and torch.distributed.checkpoint (DCP), and
`zoff convert` against a naive "load all shards, merge, save" export. CPU, gloo, 2 ranks.

Not a test. The model is zoff's builtin GPT in fp32 (default 12 layers x 768: ~85M parameters), trained one
step at ZeRO stage 3 so that the Adam moments are populated. Every variant saves the same ~1 GB of state
(fp32 master + exp_avg + exp_avg_sq of every parameter, 12 B/param) into a fresh folder on local disk:

zoff        checkpoint.save_checkpoint: each rank writes its shard (safetensors), sha256, fsync, manifest,
            rename, `latest`. Load: checkpoint.load_checkpoint (verifies every file's checksum, as resume does).
torch.save  rank 0 writes {model state_dict, optimizer state_dict}-shaped full state (gathered once, before
            timing, as a DDP trainer would simply have it), then fsync, for parity with zoff and DCP.
            Load: torch.load on every rank (a DDP resume).
dcp         torch.distributed.checkpoint.save of the same shards as DTensors (Shard(0) over a 2-rank mesh),
            FileSystemWriter defaults (one file per rank, fsync). Load: dcp.load in place.

ONE 2-rank job keeps all three alive and interleaves rounds (zoff, torch.save, dcp / torch.save, dcp, zoff /
...). This host's memory and disk bandwidth switch between modes and other work shares the machine, so only
ratios within a round mean something: the table reports medians of per-round ratios (and quartiles), with
median seconds and GB/s for scale. Reads follow writes, so loads are page-cache-hot.

Convert: `zoff convert` (the real CLI entry point; it first verifies every file's checksum) and the naive
export (safetensors load_file of every shard, merge the master pieces per the manifest, save_file) each run
in a fresh subprocess that imports everything, resets its peak-RSS mark (/proc/self/clear_refs), converts,
and reports VmHWM growth over the post-import RSS, plus sampled peaks of its heap (RssAnon) and file-backed
(RssFile) parts. load_file maps the shards, so the naive export's untouched Adam moments never become
resident: it is the kindest naive baseline (its peak is the merged model plus the mapped master pages).

    python scripts/bench_checkpoint.py [--layers 12] [--d-model 768] [--rounds 5] [--tmp /tmp]
        [--out docs/results/bench_checkpoint.json]
    python scripts/bench_checkpoint.py --render   # the markdown tables from the JSON (what the docs embed)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

REPO = Path(__file__).resolve().parent.parent

import benchlib  # noqa: E402
from benchlib import spawn  # noqa: E402

# The reporting side is checkpoint_report.py (render_docs.py and the tests call render() from here)
from checkpoint_report import (  # noqa: E402
    GB,
    VARIANTS,
    WORLD,
    convert_result,
    print_tables,
    render,
    summarize,
    targets,
)

from zoff.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from zoff.checkpoint.format import step_dir_name  # noqa: E402
from zoff.config import Config, config_from_dict, dump_yaml  # noqa: E402
from zoff.engine import ZeroEngine  # noqa: E402
from zoff.engine.partition import PartitionPlan  # noqa: E402
from zoff.models import build_model, lm_loss  # noqa: E402
from zoff.trainer.session import Session, build_session  # noqa: E402

JSON = benchlib.RESULTS / "bench_checkpoint.json"


def make_cfg(args: dict) -> Config:
    return config_from_dict(
        {
            "model": {
                "name": "gpt",
                "n_layer": args["layers"],
                "n_head": max(1, args["d_model"] // 64),
                "d_model": args["d_model"],
                "seq_len": args["seq_len"],
            },
            "data": {"name": "synthetic", "seq_len": args["seq_len"], "batch_size": 1},
            "zero": {"stage": 3},
            "train": {"precision": "fp32", "seed": 0, "grad_clip": 1.0},
        }
    )


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -------------------------------------------------------------------------------------- the 2-rank job
def trained_session(args: dict) -> tuple[Session, Config]:
    """The model after one step at stage 3, so that the Adam moments every variant saves are populated."""
    torch.set_num_threads(args["threads"])
    cfg = make_cfg(args)
    s = build_session(cfg, torch.device("cpu"))
    eng = s.engine
    x, y = s.batches.micro_batch_at(0, 0)
    eng.zero_grad()
    eng.backward(lm_loss(eng.model(x), y), sync=True)
    eng.step(cfg.optim.lr)
    return s, cfg


def full_state(eng: ZeroEngine, moments: dict, lr: float) -> dict:
    """torch.save's full state: what rank 0 of a DDP job holds (gathered once here, not timed). Every rank
    calls it: the gathers are collectives."""
    plan = eng.plan
    params = eng.gathered_params()
    full_opt: dict[int, dict] = {}
    for u, unit in enumerate(plan.units):
        full = {k: torch.zeros(unit.padded) for k in ("exp_avg", "exp_avg_sq")}
        for k in full:
            eng.comm.all_gather(moments[k][u].float(), full[k])
        for si in unit.slots:
            sl = plan.slots[si]
            full_opt[si] = {
                "step": torch.tensor(float(moments["step"])),
                **{k: v[sl.offset : sl.offset + sl.numel].view(sl.shape).clone() for k, v in full.items()},
            }
    names = {n: i for i, sl in enumerate(plan.slots) for n in sl.names}
    return {
        "model": params,
        "optimizer": {
            "state": full_opt,
            "param_groups": [{"params": sorted(set(names.values())), "lr": lr}],
        },
    }


def dcp_state(plan: PartitionPlan, state: dict, world: int) -> dict[str, DTensor]:
    """DCP's state: the same shards (the engine's state_dict), as DTensors of each unit's flat (padded) buffer."""
    masters, moments = state["masters"], state["optimizer"]
    mesh = init_device_mesh("cpu", (world,))

    def as_dtensor(t: torch.Tensor, u: int) -> DTensor:
        n = plan.units[u].shard
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(n * world,), stride=(1,))

    shards = {}
    for u in range(len(plan.units)):
        shards[f"u{u}.master"] = as_dtensor(masters[u], u)
        shards[f"u{u}.exp_avg"] = as_dtensor(moments["exp_avg"][u], u)
        shards[f"u{u}.exp_avg_sq"] = as_dtensor(moments["exp_avg_sq"][u], u)
    return shards


class Checkpointers:
    """The same trained state as each variant saves and loads it: zoff's shards, rank 0's full state for
    torch.save, the shards as DTensors for DCP."""

    def __init__(self, s: Session, cfg: Config, rank: int, world: int) -> None:
        self.batches, self.eng, self.rank = s.batches, s.engine, rank
        self.config_yaml = dump_yaml(cfg)
        state = self.eng.state_dict()
        self.full_state: dict | None = full_state(self.eng, state["optimizer"], cfg.optim.lr)
        if rank != 0:  # only rank 0 writes it
            self.full_state = None
        self.dcp_state = dcp_state(self.eng.plan, state, world)

    def save(self, kind: str, d: Path) -> None:
        if kind == "zoff":
            save_checkpoint(self.eng, d, 1, {"step": 1, "data": self.batches.state_dict()}, self.config_yaml)
        elif kind == "torch.save":
            if self.rank == 0:
                d.mkdir(parents=True)
                with open(d / "state.pt", "wb") as f:
                    torch.save(self.full_state, f)
                    f.flush()
                    os.fsync(f.fileno())
        else:
            dcp.save(self.dcp_state, checkpoint_id=str(d))

    def load(self, kind: str, d: Path) -> None:
        if kind == "zoff":
            load_checkpoint(self.eng, d / step_dir_name(1))
        elif kind == "torch.save":
            loaded = torch.load(d / "state.pt", map_location="cpu", weights_only=True)
            del loaded
        else:
            dcp.load(self.dcp_state, checkpoint_id=str(d))


def timed(fn: Callable[[], object]) -> float:
    """Seconds for every rank to finish fn, from a common start."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def bench_variant(ck: Checkpointers, kind: str, d: Path, convert_src: Path | None) -> dict:
    """One variant's save then load into `d`: seconds and bytes. The folder is deleted afterwards, or kept as
    `convert_src` (the last zoff checkpoint feeds the convert benchmark)."""
    t_save = timed(lambda: ck.save(kind, d))
    t_load = timed(lambda: ck.load(kind, d))
    dist.barrier()
    res = {"save_s": t_save, "load_s": t_load, "bytes": du(d) if ck.rank == 0 else 0}
    if kind == "zoff":  # the same load without the checksum pass over every file, to show its share
        res["load_noverify_s"] = timed(lambda: load_checkpoint(ck.eng, d / step_dir_name(1), verify=False))
    dist.barrier()
    if ck.rank == 0:
        os.rename(d, convert_src) if convert_src else shutil.rmtree(d)
    dist.barrier()
    return res


def bench_rank(rank: int, world: int, args: dict, tmp: str) -> dict:
    s, cfg = trained_session(args)
    ck = Checkpointers(s, cfg, rank, world)
    rounds = []
    root = Path(tmp)
    for r in range(-1, args["rounds"]):  # round -1 warms up every code path and is not reported
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        row = {}
        for kind in order:
            d = root / f"round{r}-{kind.replace('.', '_')}"
            last_zoff = kind == "zoff" and r == args["rounds"] - 1
            row[kind] = bench_variant(ck, kind, d, root / "convert-src" if last_zoff else None)
        if r >= 0:
            rounds.append({"order": list(order), **row})
        if rank == 0:
            cells = "  ".join(f"{k} {row[k]['save_s']:.2f}/{row[k]['load_s']:.2f}s" for k in order)
            print(f"  round {r:>2} (save/load): {cells}", flush=True)
    plan = s.engine.plan
    return {"rounds": rounds, "shard_numel": plan.shard_numel(), "numel": plan.numel}


# -------------------------------------------------------------------------------------- convert
MEASURE = r"""
import json, sys, threading, time
from pathlib import Path
import safetensors.torch, torch, zoff.cli, zoff.checkpoint.convert  # noqa: F401
from safetensors.torch import load_file, save_file

mode, report_path, ckpt, out = sys.argv[1:5]

def status():
    res = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                res[key] = int(value.split()[0]) * 1024
    return res

def naive(ckpt, out):
    # load all shards, merge, save: the obvious implementation
    ck = Path(ckpt)
    if (ck / "latest").is_file():
        ck = ck / (ck / "latest").read_text().strip()
    m = json.loads((ck / "manifest.json").read_text())
    shards = {name: load_file(str(ck / name)) for name in m["files"] if name.startswith("shard_")}
    merged = {}
    for p in m["params"]:
        for name in p["names"]:  # tied names get their own copy: save_file refuses shared storage
            flat = torch.empty(p["shape"]).reshape(-1)
            for piece in p["pieces"]:
                s, n, ps = piece["start"], piece["length"], piece["param_start"]
                flat[ps : ps + n] = shards[piece["file"]][f"u{piece['unit']}.master"][s : s + n]
            merged[name] = flat.view(p["shape"])
    extra = load_file(str(ck / "extra.safetensors"))
    merged.update({k: v for k, v in extra.items() if k != "__empty__"})
    order = m.get("state_dict_keys") or list(merged)
    save_file({k: merged[k] for k in order if k in merged}, out)

reset = True
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    reset = False
base = status()
peak = dict(base)
stop = False

def sample():
    while not stop:
        for k, v in status().items():
            peak[k] = max(peak[k], v)
        time.sleep(0.002)

t = threading.Thread(target=sample, daemon=True)
t.start()
t0 = time.perf_counter()
if mode == "zoff":
    sys.argv = ["zoff", "convert", ckpt, out]
    try:
        zoff.cli.main()
    except SystemExit as e:
        if e.code:
            raise
else:
    naive(ckpt, out)
elapsed = time.perf_counter() - t0
stop = True
t.join()
after = status()
json.dump({"elapsed_s": elapsed, "hwm_reset": reset, "base": base, "after": after, "sampled_peak": peak},
          open(report_path, "w"))
"""


def measure_convert(mode: str, ckpt: Path, out: Path) -> dict:
    report = out.with_suffix(".report.json")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", MEASURE, mode, str(report), str(ckpt), str(out)],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{mode} convert failed:\n{p.stderr}")
    out_bytes = du(out) if out.is_dir() else out.stat().st_size
    res = convert_result(json.loads(report.read_text()), wall, out_bytes)
    shutil.rmtree(out) if out.is_dir() else out.unlink()
    return res


def machine(tmp: Path) -> dict:
    """What benchlib's machine() leaves out and a checkpoint's speed depends on: the scratch folder's
    filesystem, and how busy the host was."""
    mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
    best = max(
        (m for m in mounts if str(tmp.resolve()).startswith(m[1])), key=lambda m: len(m[1]), default=None
    )
    return {
        "tmp_dir_fs": f"{best[0]} ({best[2]}) on {best[1]}" if best else "?",
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
    }


# -------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // WORLD), help="per rank")
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="local-disk scratch parent")
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown tables from --out's JSON")
    args = ap.parse_args()
    if args.render:
        sys.exit(benchlib.print_rendered(args.out, render))
    a = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}

    with torch.device("meta"):
        psi = sum(p.numel() for p in build_model(make_cfg(a).model).parameters())
    print(f"GPT {psi / 1e6:.1f}M params: {12 * psi / GB:.2f} GB of master + Adam state per save", flush=True)
    prov = benchlib.provenance()
    prov["machine"].update(machine(args.tmp))
    result: dict = {
        **prov,
        "command": benchlib.command_line(ap, args, "bench_checkpoint"),
        "args": a,
        "params": psi,
    }
    tmp = Path(tempfile.mkdtemp(prefix="zoff-bench-ckpt-", dir=args.tmp))
    try:
        print(f"save/load: {', '.join(VARIANTS)} interleaved in one {WORLD}-rank job ({tmp})", flush=True)
        ranks = spawn(bench_rank, WORLD, a, str(tmp))
        result["rounds"] = ranks[0]["rounds"]
        result["summary"] = summarize(ranks[0]["rounds"])
        conv = {}
        for mode in ("zoff", "naive"):
            print(f"convert: {mode} in a fresh subprocess", flush=True)
            conv[mode] = measure_convert(mode, tmp / "convert-src", tmp / f"{mode}.safetensors")
        result["convert"] = conv
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    result["targets"] = targets(result["summary"], result["convert"])
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    sys.stdout.write(render(result))


if __name__ == "__main__":
    main()
