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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

REPO = Path(__file__).resolve().parent.parent

import benchlib  # noqa: E402
from benchlib import print_targets, spawn  # noqa: E402

from zoff.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from zoff.checkpoint.format import step_dir_name  # noqa: E402
from zoff.config import Config, config_from_dict, dump_yaml  # noqa: E402
from zoff.models import build_model, lm_loss  # noqa: E402
from zoff.trainer.session import build_session  # noqa: E402

JSON = benchlib.RESULTS / "bench_checkpoint.json"
WORLD = 2
VARIANTS = ("zoff", "torch.save", "dcp")
GB = 1e9
MiB = 2**20
SAVE_TARGET = 1.2  # zoff save time <= 1.2 x DCP's
RSS_TARGET = 0.25  # zoff convert peak RSS growth <= 1/4 of the naive export's


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
def bench_rank(rank: int, world: int, args: dict, tmp: str) -> dict:
    torch.set_num_threads(args["threads"])
    cfg = make_cfg(args)
    s = build_session(cfg, torch.device("cpu"))
    eng = s.engine
    x, y = s.batches.micro_batch_at(0, 0)
    eng.zero_grad()
    eng.backward(lm_loss(eng.model(x), y), sync=True)
    eng.step(cfg.optim.lr)
    config_yaml = dump_yaml(cfg)
    state = eng.state_dict()
    masters, moments = state["masters"], state["optimizer"]
    plan = eng.plan

    # torch.save's full state: what rank 0 of a DDP job holds (gathered once here, not timed).
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
    full_state = {
        "model": params,
        "optimizer": {
            "state": full_opt,
            "param_groups": [{"params": sorted(set(names.values())), "lr": cfg.optim.lr}],
        },
    }
    if rank != 0:
        full_state = None
    del params, full_opt

    # DCP's state: the same shards, as DTensors of each unit's flat (padded) buffer.
    mesh = init_device_mesh("cpu", (world,))

    def as_dtensor(t: torch.Tensor, u: int) -> DTensor:
        n = plan.units[u].shard
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(n * world,), stride=(1,))

    dcp_state = {}
    for u in range(len(plan.units)):
        dcp_state[f"u{u}.master"] = as_dtensor(masters[u], u)
        dcp_state[f"u{u}.exp_avg"] = as_dtensor(moments["exp_avg"][u], u)
        dcp_state[f"u{u}.exp_avg_sq"] = as_dtensor(moments["exp_avg_sq"][u], u)

    def save(kind: str, d: Path) -> None:
        if kind == "zoff":
            save_checkpoint(eng, d, 1, {"step": 1, "data": s.batches.state_dict()}, config_yaml)
        elif kind == "torch.save":
            if rank == 0:
                d.mkdir(parents=True)
                with open(d / "state.pt", "wb") as f:
                    torch.save(full_state, f)
                    f.flush()
                    os.fsync(f.fileno())
        else:
            dcp.save(dcp_state, checkpoint_id=str(d))

    def load(kind: str, d: Path) -> None:
        if kind == "zoff":
            load_checkpoint(eng, d / step_dir_name(1))
        elif kind == "torch.save":
            loaded = torch.load(d / "state.pt", map_location="cpu", weights_only=True)
            del loaded
        else:
            dcp.load(dcp_state, checkpoint_id=str(d))

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    rounds = []
    root = Path(tmp)
    for r in range(-1, args["rounds"]):  # round -1 warms up every code path and is not reported
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        row = {}
        for kind in order:
            d = root / f"round{r}-{kind.replace('.', '_')}"
            t_save = timed(lambda kind=kind, d=d: save(kind, d))
            t_load = timed(lambda kind=kind, d=d: load(kind, d))
            dist.barrier()
            nbytes = du(d) if rank == 0 else 0
            row[kind] = {"save_s": t_save, "load_s": t_load, "bytes": nbytes}
            if kind == "zoff":  # the same load without the checksum pass over every file, to show its share
                no_verify = lambda d=d: load_checkpoint(eng, d / step_dir_name(1), verify=False)  # noqa: E731
                row[kind]["load_noverify_s"] = timed(no_verify)
            dist.barrier()
            if rank == 0:
                if kind == "zoff" and r == args["rounds"] - 1:
                    os.rename(d, root / "convert-src")  # the last zoff checkpoint feeds the convert benchmark
                else:
                    shutil.rmtree(d)
            dist.barrier()
        if r >= 0:
            rounds.append({"order": list(order), **row})
        if rank == 0:
            cells = "  ".join(f"{k} {row[k]['save_s']:.2f}/{row[k]['load_s']:.2f}s" for k in order)
            print(f"  round {r:>2} (save/load): {cells}", flush=True)
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
    r = json.loads(report.read_text())
    base, after, peak = r["base"], r["after"], r["sampled_peak"]
    out_bytes = du(out) if out.is_dir() else out.stat().st_size
    res = {
        "elapsed_s": r["elapsed_s"],
        "process_wall_s": wall,
        "output_bytes": out_bytes,
        "gb_per_s": out_bytes / r["elapsed_s"] / GB,
        "peak_rss_bytes": after["VmHWM"],
        "peak_rss_growth_bytes": after["VmHWM"] - base["VmRSS"],
        "sampled_heap_growth_bytes": peak["RssAnon"] - base["RssAnon"],
        "sampled_file_backed_growth_bytes": peak["RssFile"] - base["RssFile"],
        "hwm_reset": r["hwm_reset"],
    }
    shutil.rmtree(out) if out.is_dir() else out.unlink()
    return res


# -------------------------------------------------------------------------------------- reporting
def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(rounds: list[dict]) -> dict:
    out: dict = {"variants": {}, "ratios": {}}
    for kind in VARIANTS:
        v = {"bytes": statistics.median(r[kind]["bytes"] for r in rounds)}
        for op in ("save", "load"):
            secs = [r[kind][f"{op}_s"] for r in rounds]
            v[f"{op}_s"] = statistics.median(secs)
            v[f"{op}_gb_per_s"] = statistics.median(
                r[kind]["bytes"] / r[kind][f"{op}_s"] / GB for r in rounds
            )
        out["variants"][kind] = v
    z = out["variants"]["zoff"]
    z["load_noverify_s"] = statistics.median(r["zoff"]["load_noverify_s"] for r in rounds)
    z["load_noverify_gb_per_s"] = statistics.median(
        r["zoff"]["bytes"] / r["zoff"]["load_noverify_s"] / GB for r in rounds
    )
    for op, zkey in (("save", "save_s"), ("load", "load_s"), ("load", "load_noverify_s")):
        for base in ("dcp", "torch.save"):
            xs = [r["zoff"][zkey] / r[base][f"{op}_s"] for r in rounds]
            name = f"zoff/{base} {op}" + (" (zoff without verify)" if "noverify" in zkey else "")
            out["ratios"][name] = {"median": statistics.median(xs), "q1_q3": quartiles(xs), "per_round": xs}
    return out


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


def targets(summary: dict, conv: dict) -> list[dict]:
    save = summary["ratios"]["zoff/dcp save"]["median"]
    rss = conv["zoff"]["peak_rss_growth_bytes"] / conv["naive"]["peak_rss_growth_bytes"]
    heap = conv["zoff"]["sampled_heap_growth_bytes"] / conv["naive"]["sampled_heap_growth_bytes"]
    return [
        {"target": "zoff save time / DCP save time", "value": save, "limit": SAVE_TARGET,
         "result": "PASS" if save <= SAVE_TARGET else "MISS"},
        {"target": "zoff convert peak RSS growth / naive's", "value": rss, "limit": RSS_TARGET,
         "result": "PASS" if rss <= RSS_TARGET else "MISS"},
        {"target": "  (info) heap-only (RssAnon) growth / naive's", "value": heap, "limit": RSS_TARGET,
         "result": "info"},
    ]  # fmt: skip


def print_tables(result: dict) -> None:
    con = Console(width=max(120, Console().width))
    m, s, c = result["machine"], result["summary"], result["convert"]
    con.print(
        f"[bold]{result['params'] / 1e6:.1f}M-param GPT (fp32), {WORLD} ranks gloo, {result['args']['rounds']} "
        f"rounds[/bold]; {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB; tmp on {m['tmp_dir_fs']}; "
        f"torch {m['torch']}; load avg {' '.join(m['loadavg_start'])} -> {' '.join(m['loadavg_end'])}"
    )
    tab = Table(title="save / load (medians over rounds; loads are page-cache-hot)")
    for col in ("variant", "bytes", "save s", "save GB/s", "load s", "load GB/s"):
        tab.add_column(col, justify="right" if col != "variant" else "left")
    for kind, v in s["variants"].items():
        tab.add_row(
            kind, f"{v['bytes'] / GB:.2f} GB", f"{v['save_s']:.2f}", f"{v['save_gb_per_s']:.2f}",
            f"{v['load_s']:.2f}", f"{v['load_gb_per_s']:.2f}",
        )  # fmt: skip
    z = s["variants"]["zoff"]
    tab.add_row(
        "zoff load w/o verify",
        "",
        "",
        "",
        f"{z['load_noverify_s']:.2f}",
        f"{z['load_noverify_gb_per_s']:.2f}",
    )
    con.print(tab)
    tab = Table(title="per-round time ratios (median, quartiles)")
    tab.add_column("ratio")
    tab.add_column("median", justify="right")
    tab.add_column("q1-q3", justify="right")
    for k, v in s["ratios"].items():
        tab.add_row(k, f"{v['median']:.2f}", f"{v['q1_q3'][0]:.2f}-{v['q1_q3'][1]:.2f}")
    con.print(tab)
    tab = Table(title="convert (fresh subprocess each; growth over the post-import RSS)")
    for col in ("exporter", "time s", "GB/s", "peak RSS", "peak growth", "heap growth*", "file-backed*"):
        tab.add_column(col, justify="right" if col != "exporter" else "left")
    for k, v in c.items():
        tab.add_row(
            k, f"{v['elapsed_s']:.2f}", f"{v['gb_per_s']:.2f}", f"{v['peak_rss_bytes'] / MiB:.0f} MiB",
            f"{v['peak_rss_growth_bytes'] / MiB:.0f} MiB", f"{v['sampled_heap_growth_bytes'] / MiB:.0f} MiB",
            f"{v['sampled_file_backed_growth_bytes'] / MiB:.0f} MiB",
        )  # fmt: skip
    con.print(tab)
    con.print("  * sampled every 2 ms (RssAnon / RssFile); peak growth is the kernel's exact VmHWM")
    print_targets(con, "targets (issue 5)", result["targets"])


LABEL = {
    "zoff": "zoff",
    "torch.save": "torch.save (rank 0, full state)",
    "dcp": "torch.distributed.checkpoint",
}


def render(data: dict) -> str:
    """The markdown tables the docs embed: save and load per variant with zoff's per-round ratios, the export
    against the naive one, the targets; pure."""
    s, c, a = data["summary"], data["convert"], data["args"]
    v, r = s["variants"], s["ratios"]
    ratio = lambda key: "{:.2f}x ({:.2f}-{:.2f})".format(r[key]["median"], *r[key]["q1_q3"])  # noqa: E731
    out = [
        f"{data['params'] / 1e6:.1f}M-parameter GPT ({a['layers']} layers x {a['d_model']}), fp32, {WORLD} ranks, "
        f"{v['zoff']['bytes'] / GB:.2f} GB per checkpoint (master + Adam moments), {a['rounds']} interleaved "
        f"rounds, scratch on {data['machine']['tmp_dir_fs']}; medians of rounds, ratios as median (q1-q3) of "
        "per-round ratios; loads follow saves, page-cache-hot.\n\n"
    ]
    rows = [
        ["save s", *(f"{v[k]['save_s']:.2f}" for k in VARIANTS)],
        ["save GB/s", *(f"{v[k]['save_gb_per_s']:.2f}" for k in VARIANTS)],
        ["zoff / peer, save", "", ratio("zoff/torch.save save"), ratio("zoff/dcp save")],
        ["load s", *(f"{v[k]['load_s']:.2f}" for k in VARIANTS)],
        ["load s, zoff without checksum verify", f"{v['zoff']['load_noverify_s']:.2f}", "", ""],
        ["zoff / peer, load", "", ratio("zoff/torch.save load"), ratio("zoff/dcp load")],
    ]
    out += [benchlib.md_table(["", *(LABEL[k] for k in VARIANTS)], rows), "\n"]
    names = {"zoff": "`zoff convert` (streams tensor by tensor, verifies every checksum)",
             "naive": "naive: load all shards, merge, save"}  # fmt: skip
    rows = [
        [
            names[k],
            f"{x['elapsed_s']:.1f} s",
            f"{x['gb_per_s']:.2f}",
            f"{x['peak_rss_growth_bytes'] / MiB:.0f} MiB",
        ]
        + [f"{x['sampled_heap_growth_bytes'] / MiB:.0f} MiB"]
        for k, x in c.items()
    ]
    header = ["export", "time", "GB/s", "peak RSS growth (VmHWM)", "heap growth (RssAnon, sampled)"]
    out += [
        benchlib.md_table(header, rows),
        "\n",
        benchlib.md_targets(data["targets"]),
        "\n",
        benchlib.measured_line(data, "bench_checkpoint"),
    ]
    return "".join(out)


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
