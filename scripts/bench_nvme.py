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
        [--out docs/results/bench_nvme.json]
    python scripts/bench_nvme.py --render   # the markdown tables from the JSON (what the docs embed)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchlib
import torch
from benchlib import print_targets
from rich.console import Console
from rich.table import Table

from zoff.config import OptimConfig
from zoff.engine.disk.swapfile import aligned
from zoff.engine.disk.tier import DiskTier
from zoff.engine.step.optimizer import ShardOptimizer, cpu_fused_kernel
from zoff.planning.bench_io import raw_bandwidth, swap_bandwidth
from zoff.units import parse_size

JSON = benchlib.RESULTS / "bench_nvme.json"
SWAP_TARGET, STEP_TARGET = (
    0.85,
    1.25,
)  # issue 17: swap >= 85% of raw each way; step <= 1.25x bytes / bandwidth


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


def targets(rounds: list[dict]) -> list[dict]:
    """Issue 17's targets from the rounds: medians of per-round ratios, with their per-round range."""
    ratios = {
        "engine swap-out / raw write": ([x["swap_write_to_raw"] for x in rounds], ">=", SWAP_TARGET),
        "engine swap-in / raw read": ([x["swap_read_to_raw"] for x in rounds], ">=", SWAP_TARGET),
        "step / (bytes / bandwidth)": ([x["step_s"] / x["step_ideal_s"] for x in rounds], "<=", STEP_TARGET),
    }
    out = []
    for name, (xs, op, limit) in ratios.items():
        value = statistics.median(xs)
        ok = value >= limit if op == ">=" else value <= limit
        out.append({"target": name, "value": value, "range": [min(xs), max(xs)], "limit": limit, "op": op,
                    "result": "PASS" if ok else "MISS"})  # fmt: skip
    return out


def render(data: dict) -> str:
    """The markdown tables the docs embed: bandwidth per way (medians over rounds) and the targets; pure."""
    rounds = data["rounds"]
    med = lambda f: statistics.median(f(x) for x in rounds)  # noqa: E731
    way = lambda key: [f"{med(lambda x: x[key]['write']):.2f}", f"{med(lambda x: x[key]['read']):.2f}"]  # noqa: E731
    moved = 12 * data["params_numel"]  # bytes of states read, and written, by one step
    rows = [
        ["raw `O_DIRECT`, the engine's I/O alone ({threads} threads x {request}, sequential)".format(**data["args"]),
         *way("raw")],
        ["`dd bs=8M oflag=direct` / `iflag=direct`", *way("dd")],
        ["engine swap-out / swap-in of whole units, one way at a time", *way("swap")],
        ["engine swap, both ways at once as in a step", f"{med(lambda x: x['swap']['both']):.2f} combined", ""],
        [f"NVMe optimizer step, {data['params_numel'] / 1e6:.0f}M parameters (CPU Adam included)",
         f"{med(lambda x: x['step_s']):.2f} s against {med(lambda x: x['step_ideal_s']):.2f} s for "
         f"{2 * moved / 1e9:.1f} GB at the raw figures one after the other", ""],
    ]  # fmt: skip
    out = [
        f"`{data['args']['path']}`, {len(rounds)} rounds, medians; {moved / 1e9:.1f} GB of states read and "
        f"{moved / 1e9:.1f} GB written per step.\n\n",
        benchlib.md_table(["", "write GB/s", "read GB/s"], rows),
        "\n",
        benchlib.md_targets(targets(rounds)),
        "\n",
        benchlib.measured_line(data, "bench_nvme"),
    ]
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--path", type=Path, help="a folder on the disk to measure (local NVMe); required to measure"
    )
    ap.add_argument("--params", default="500M", help="the optimizer step's shard, in parameters")
    ap.add_argument(
        "--unit", default="32M", help="parameters per unit (engine: reduce_bucket_size / stage 3 module)"
    )
    ap.add_argument("--file", default="2G", help="bytes of the raw and dd runs")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--request", default="8M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown tables from --out's JSON")
    a = ap.parse_args()
    if a.render:
        sys.exit(benchlib.print_rendered(a.out, render))
    if a.path is None:
        ap.error("--path is required to measure")
    prov = benchlib.provenance()
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
    verdicts = targets(rounds)
    eff = {"write": verdicts[0]["value"], "read": verdicts[1]["value"]}
    step_ratio = verdicts[2]["value"]
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
    print_targets(con, "targets (issue 17)", verdicts)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**prov, "command": benchlib.command_line(ap, a, "bench_nvme"), "args": {k: str(v) for k, v in vars(a).items()},
              "params_numel": numel, "rounds": rounds, "swap_to_raw": eff, "step_ratio": step_ratio,
              "loadavg": os.getloadavg()}  # fmt: skip
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    con.print(f"wrote {a.out}")
    sys.stdout.write(render(result))


if __name__ == "__main__":
    main()
