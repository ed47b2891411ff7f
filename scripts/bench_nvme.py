#!/usr/bin/env python
"""Benchmark zoff's disk tier against the disk itself, in one run on one path.

Not a test. Per round, in turn (A B C D E ... A B C D E ...): the raw O_DIRECT sequential write and read of a
file with the engine's request size and thread count (disk_io.SwapFile on its own), `dd` with
oflag=direct / iflag=direct as a second reference, the engine's swap-out and swap-in of whole units
(state_swap.SwappedStates with no compute: out alone, in alone, both as a step overlaps them), and one optimizer step of the NVMe tier over an N-parameter shard
(read 12 N bytes, CPU Adam, write 12 N bytes). Disk bandwidth here is noisy and shared: only ratios within a
round mean something, and the table reports medians of per-round ratios (and median bandwidths for scale).

Targets (issue 17): engine swap >= 85% of raw in each direction (per-round ratios); the step within 1.25x of bytes moved /
measured bandwidth (12 N / read + 12 N / write, the raw figures of the same round).

    python scripts/bench_nvme.py --path /var/tmp/zoff-bench [--params 500M] [--file 2G] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
from benchlib import print_targets
from rich.console import Console
from rich.table import Table

from zoff.config import OptimConfig
from zoff.engine.disk_io import aligned
from zoff.engine.optimizer import ShardOptimizer, cpu_fused_kernel
from zoff.engine.tiers import DiskTier
from zoff.planning.bench_io import raw_bandwidth, swap_bandwidth
from zoff.units import parse_size


def dd(path: Path, nbytes: int) -> dict[str, float]:
    """dd with O_DIRECT both ways, 8 MiB blocks: GB/s as dd measures it (wall clock around the command)."""
    target, count = path / "dd.bin", max(1, nbytes // (8 << 20))
    out = {}
    for kind, args in (
        ("write", ["if=/dev/zero", f"of={target}", "oflag=direct", "conv=fsync"]),
        ("read", [f"if={target}", "of=/dev/null", "iflag=direct"]),
    ):
        t0 = time.perf_counter()
        subprocess.run(["dd", *args, "bs=8M", f"count={count}"], check=True, capture_output=True)
        out[kind] = count * (8 << 20) / (time.perf_counter() - t0) / 1e9
    target.unlink(missing_ok=True)
    return out


def make_optimizer(
    path: Path, numel: int, unit: int, threads: int, request: int
) -> tuple[ShardOptimizer, list]:
    shards = [torch.randn(min(unit, numel - a)) for a in range(0, numel, unit)]
    tier = DiskTier(None, torch.float32, False, path, threads, request >> 20)
    runs = [[(0, s.numel(), True)] for s in shards]
    opt = ShardOptimizer(
        shards, runs, OptimConfig(lr=1e-4), tier, cpu_fused_kernel, threads=torch.get_num_threads()
    )
    return opt, [torch.randn_like(s) * 1e-3 for s in shards]


def step(opt: ShardOptimizer, grads: list) -> float:
    t0 = time.perf_counter()
    opt.step(grads, 1e-4)
    opt.states._drain()
    os.fsync(opt.states.file.fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", type=Path, required=True, help="a folder on the disk to measure (local NVMe)")
    ap.add_argument("--params", default="500M", help="the optimizer step's shard, in parameters")
    ap.add_argument(
        "--unit", default="32M", help="parameters per unit (engine: reduce_bucket_size / stage 3 module)"
    )
    ap.add_argument("--file", default="2G", help="bytes of the raw and dd runs")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--request", default="8M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/bench_nvme.json"))
    a = ap.parse_args()
    numel, unit = parse_size(a.params, "--params"), parse_size(a.unit, "--unit")
    nbytes, request = aligned(parse_size(a.file, "--file")), aligned(parse_size(a.request, "--request"))
    work = a.path / f"zoff-bench-{os.getpid()}"
    work.mkdir(parents=True)
    con = Console()
    try:
        opt, grads = make_optimizer(work / "tier", numel, unit, a.threads, request)
        rounds = []
        for r in range(a.rounds):
            row = {"raw": raw_bandwidth(work, nbytes, a.threads, request >> 20), "dd": dd(work, nbytes)}
            row["swap"] = swap_bandwidth(opt.states)
            row["step_s"] = step(opt, grads)
            moved = 12 * numel
            row["step_ideal_s"] = moved / (row["raw"]["read"] * 1e9) + moved / (row["raw"]["write"] * 1e9)
            for way in ("read", "write"):  # the engine's swap-in / swap-out against the raw disk, this round
                row[f"swap_{way}_to_raw"] = row["swap"][way] / row["raw"][way]
            rounds.append(row)
            con.print(f"round {r + 1}: {json.dumps(row)}")
        opt.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = lambda f: statistics.median(f(x) for x in rounds)  # noqa: E731
    eff = {way: med(lambda x, w=way: x[f"swap_{w}_to_raw"]) for way in ("read", "write")}
    step_ratio = med(lambda x: x["step_s"] / x["step_ideal_s"])
    tab = Table(
        title=f"zoff disk tier on {a.path} ({numel / 1e6:.0f}M-param shard, {a.rounds} rounds, medians)"
    )
    for col in ("what", "write GB/s", "read GB/s"):
        tab.add_column(col)
    rows = [("raw O_DIRECT (engine I/O)", "raw"), ("dd oflag/iflag=direct", "dd"),
            ("engine swap-out / swap-in (one way at a time)", "swap")]  # fmt: skip
    for label, key in rows:
        tab.add_row(
            label, f"{med(lambda x, k=key: x[k]['write']):.2f}", f"{med(lambda x, k=key: x[k]['read']):.2f}"
        )
    tab.add_row(
        "engine swap, both ways as a step overlaps them",
        f"{med(lambda x: x['swap']['both']):.2f} combined",
        "",
    )
    con.print(tab)
    con.print(
        f"optimizer step: {med(lambda x: x['step_s']):.2f} s, ideal {med(lambda x: x['step_ideal_s']):.2f} s"
    )
    targets = [
        {"target": "engine swap-out / raw write", "value": eff["write"], "limit": 0.85, "op": ">=", "result": "PASS" if eff["write"] >= 0.85 else "MISS"},
        {"target": "engine swap-in / raw read", "value": eff["read"], "limit": 0.85, "op": ">=", "result": "PASS" if eff["read"] >= 0.85 else "MISS"},
        {"target": "step / (bytes / bandwidth)", "value": step_ratio, "limit": 1.25, "result": "PASS" if step_ratio <= 1.25 else "MISS"},
    ]  # fmt: skip
    print_targets(con, "targets (issue 17)", targets)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rounds": rounds,
                                 "swap_to_raw": eff, "step_ratio": step_ratio,
                                 "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2))  # fmt: skip
    con.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
