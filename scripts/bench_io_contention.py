#!/usr/bin/env python
"""What the disk tier's I/O costs the cores: a compute loop alone, then beside the engine's own O_DIRECT reads,
writes, or both, interleaved round by round in one job (issue 32's floor assumes the two are independent).

    python scripts/bench_io_contention.py [--path /var/tmp/zoff-swap] [--rounds 3] [--seconds 5]
    python scripts/bench_io_contention.py --render

The compute is the 3.4B demo's shape: bf16 matmuls of 256 tokens through a 3072 x 12288 weight on the
rank's threads (both cores); fp32 on a CPU without fast bf16 kernels (no AVX512: ~100x fp32's time, a
matmul or two per window; the JSON's cpu_precision and the table say so), unless --native-precision. The
I/O is zoff's SwapFile at the disk tier's defaults (4 threads of 8 MiB requests), looping over a 2 GiB file
in a background thread, as the engine's I/O runs beside its compute. Per mode: the matmul rate against the same round's "alone" (median over rounds), the disk's GB/s meanwhile,
and the share of the cores the kernel took (sys + softirq from /proc/stat). On a host where I/O costs no
CPU every ratio is 1.0 and floor = max(compute, disk) is reachable; below 1, compute and disk cannot both
run at full speed at once, and a step's floor is higher than that formula says.

First, the I/O alone: the same file read and written whole from buffers of plain 4 KiB pages and from
buffers with transparent huge pages (AlignedBuffer's default), interleaved: GB/s and the kernel's core-seconds
per GB (O_DIRECT pins every page of every request).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib
import torch

from zoff.engine.disk.swapfile import AlignedBuffer, SwapFile, wait

JSON = benchlib.RESULTS / "bench_io_contention.json"
MODES = ("alone", "reads", "writes", "reads+writes")
FILE_BYTES, CHUNK = 2 << 30, 256 << 20


def cpu_times() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]


class IoLoop:
    """Reads and/or writes the file chunk by chunk in a background thread until stopped; counts bytes."""

    def __init__(self, f: SwapFile, bufs: tuple[AlignedBuffer, AlignedBuffer], reads: bool, writes: bool):
        self.f, self.bufs, self.reads, self.writes = f, bufs, reads, writes
        self.bytes, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        off = 0
        while not self.stop.is_set():
            futs = []
            if self.reads:
                futs += self.f.read(self.bufs[0].bytes, off)
            if self.writes:  # (another region: a step reads one piece while it writes another back)
                futs += self.f.write(self.bufs[1].bytes, (off + FILE_BYTES // 2) % FILE_BYTES)
            wait(futs)
            self.bytes += CHUNK * (self.reads + self.writes)
            off = (off + CHUNK) % FILE_BYTES

    def __enter__(self) -> IoLoop:
        if self.reads or self.writes:  # (alone: no thread at all; an empty loop would spin on the GIL)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def io_cost(f: SwapFile, buf: AlignedBuffer, write: bool) -> dict:
    """One pass over the file, reading or writing: GB/s and the kernel's core-seconds per GB."""
    op = f.write if write else f.read
    s0, t0 = cpu_times(), time.perf_counter()
    for off in range(0, FILE_BYTES, CHUNK):
        wait(op(buf.bytes, off))
    dt, d = time.perf_counter() - t0, [b - a for a, b in zip(s0, cpu_times(), strict=True)]
    cores = (d[2] + d[6]) / max(1, sum(d)) * (os.cpu_count() or 1) * dt  # sys + softirq, core-seconds
    return {"gbps": FILE_BYTES / dt / 1e9, "kernel_core_s_per_gb": cores / (FILE_BYTES / 1e9)}


def compute_rate(seconds: float, dtype: torch.dtype = torch.bfloat16) -> tuple[float, dict]:
    """Matmuls in `dtype` per second for `seconds`, and the cores' time shares meanwhile."""
    x = torch.randn(256, 3072, dtype=dtype)
    w = torch.randn(3072, 12288, dtype=dtype)
    n, s0, t0 = 0, cpu_times(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(x, w)
        n += 1
    dt, d = time.perf_counter() - t0, [b - a for a, b in zip(s0, cpu_times(), strict=True)]
    total = max(1, sum(d))
    return n / dt, {"sys": (d[2] + d[6]) / total, "iowait": d[4] / total, "idle": d[3] / total}


ADAM_LAYOUTS = ("plain pages", "huge pages, states at equal offsets", "huge pages, state_swap's layout")


def adam_layouts(rounds: int, numel: int = 64 << 20) -> dict[str, float]:
    """The fused CPU Adam over one piece of `numel` parameters (master and moments in one buffer, a bf16
    gradient in another) in three layouts, interleaved: median milliseconds a step each."""
    from zoff.engine.disk.placement import kind_offset
    from zoff.optim.cpu_adam import cpu_adam_step

    part, keep, sets = 4 * numel, [], {}
    for name in ADAM_LAYOUTS:
        huge = not name.startswith("plain")
        at = ([kind_offset(part, k) for k in range(3)] if name.endswith("layout")
              else [k * part for k in range(3)])  # fmt: skip
        states = AlignedBuffer(at[2] + part, huge_pages=huge)
        grad = AlignedBuffer(2 * numel, huge_pages=huge)
        keep += [states, grad]
        sets[name] = [states.view(torch.float32, a, numel).fill_(0.5) for a in at] + [
            grad.view(torch.bfloat16, 0, numel).normal_()
        ]
    times: dict[str, list[float]] = {name: [] for name in ADAM_LAYOUTS}
    for r in range(rounds):
        for name in ADAM_LAYOUTS[r % 3 :] + ADAM_LAYOUTS[: r % 3]:
            p, m, v, g = sets[name]
            for s in range(1, 4):
                t0 = time.perf_counter()
                cpu_adam_step(p, g, m, v, step=s, lr=1e-3, weight_decay=0.1, grad_scale=0.5)
                times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def render(data: dict) -> str:
    pages = [f"| {kind} | {data['pages']['plain'][kind]['gbps']:.2f} | {data['pages']['huge'][kind]['gbps']:.2f} | "
             f"{data['pages']['plain'][kind]['kernel_core_s_per_gb']:.4f} | "
             f"{data['pages']['huge'][kind]['kernel_core_s_per_gb']:.4f} |" for kind in ("read", "write")]  # fmt: skip
    rows = [f"| {m} | {data['ratio'][m]:.2f} | {data['gbps'][m]:.2f} | {data['kernel_share'][m]:.1%} |"
            for m in MODES]  # fmt: skip
    return "\n".join([
        f"The I/O alone: a {FILE_BYTES >> 30} GiB file read and written whole in {CHUNK >> 20} MiB buffers,"
        f" plain 4 KiB pages against transparent huge pages, {data['rounds']} rounds interleaved (medians).",
        "",
        "| | GB/s, plain pages | GB/s, huge pages | kernel core-s per GB, plain | kernel core-s per GB, huge |",
        "|---|---:|---:|---:|---:|",
        *pages,
        "",
        f"{(data.get('cpu_precision') or {}).get('computed', 'bf16')} matmuls (256 x 3072 @ 3072 x 12288) on"
        f" {data['threads']} threads beside zoff's O_DIRECT I/O"
        f" ({data['io_threads']} threads x {data['request_mb']} MiB, {data.get('pages_beside', 'huge')} pages) on `{data['path']}`, {data['rounds']} rounds"
        f" of {data['seconds']:g} s per mode, interleaved.",
        "",
        "| beside the compute | matmul rate / alone (median of rounds) | disk GB/s meanwhile | the kernel's share"
        " of the cores (sys + softirq) |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        *([
            "The fused CPU Adam over a 64M-parameter piece (fp32 master and moments in one buffer, a bf16 gradient"
            " in another, both cores), interleaved: with huge pages an offset is a cache set, so states at equal"
            " offsets share the cache's sets; state_swap lays a piece's states a quarter way apart.",
            "",
            "| layout | ms a step (median) |",
            "|---|---:|",
            *(f"| {name} | {ms:.1f} |" for name, ms in data["adam_ms"].items()),
            "",
        ] if "adam_ms" in data else []),
        benchlib.measured_line(data, "bench_io_contention"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", type=Path, default=Path("/var/tmp/zoff-swap"), help="a folder on the swap disk")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=2, help="compute threads (the demo's rank: both cores)")
    ap.add_argument(
        "--pages", choices=("huge", "plain"), default="huge",
        help="the buffers of the compute-beside-I/O part: the engine's (huge) or plain 4 KiB pages",
    )  # fmt: skip
    benchlib.output_args(ap, JSON)
    benchlib.native_precision_arg(ap)
    a = ap.parse_args(argv)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    cpu = benchlib.cpu_precision_plan(
        "bench_io_contention", "bf16", a.native_precision, switch=None, on_cpu=True
    )
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cpu.computed]
    torch.set_num_threads(a.threads)
    a.path.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zoff-contention-", dir=a.path))
    f = SwapFile(work / "contention.swap", FILE_BYTES, 4, 8 << 20)
    huge = AlignedBuffer(CHUNK)
    huge.bytes.fill_(7)
    beside = a.pages == "huge"
    bufs = (AlignedBuffer(CHUNK, huge_pages=beside), AlignedBuffer(CHUNK, huge_pages=beside))
    bufs[1].bytes.fill_(7)
    per: dict[str, list] = {m: [] for m in MODES}
    plain = AlignedBuffer(CHUNK, huge_pages=False)
    plain.bytes.fill_(7)
    cost: dict[str, dict[str, list]] = {v: {"read": [], "write": []} for v in ("plain", "huge")}
    try:
        for off in range(0, FILE_BYTES, CHUNK):  # written data: unwritten extents read as zeros, no disk
            wait(f.write(bufs[1].bytes, off))
        for r in range(a.rounds):
            for v in ("plain", "huge") if r % 2 == 0 else ("huge", "plain"):
                for kind in ("read", "write"):
                    cost[v][kind].append(io_cost(f, plain if v == "plain" else huge, kind == "write"))
            print(f"round {r + 1}: " + ", ".join(f"{v} {k} {cost[v][k][-1]['gbps']:.2f} GB/s" for v in cost
                                                  for k in cost[v]), flush=True)  # fmt: skip
        for r in range(a.rounds):
            got = {}
            for m in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:  # each round starts elsewhere
                with IoLoop(f, bufs, "reads" in m, "writes" in m) as io:
                    t0 = time.perf_counter()
                    rate, shares = compute_rate(a.seconds, dtype)
                    gbps = io.bytes / (time.perf_counter() - t0) / 1e9
                got[m] = {"rate": rate, "gbps": gbps, **shares}
            for m in MODES:
                per[m].append({**got[m], "ratio": got[m]["rate"] / got["alone"]["rate"]})
            print(
                f"round {r + 1}: "
                + ", ".join(
                    f"{m} {got[m]['rate']:.2f}/s {got[m]['gbps']:.2f} GB/s kernel {got[m]['sys']:.1%}"
                    for m in MODES
                ),
                flush=True,
            )
    finally:
        f.close()
        shutil.rmtree(work, ignore_errors=True)
    med = lambda m, k: statistics.median(x[k] for x in per[m])  # noqa: E731
    data = {
        **benchlib.provenance(),
        "command": benchlib.command_line(ap, a, "bench_io_contention"),
        "path": str(a.path), "rounds": a.rounds, "seconds": a.seconds, "threads": a.threads,
        "io_threads": 4, "request_mb": 8, "pages_beside": a.pages, "per_round": per,
        "cpu_precision": cpu.to_json(),
        "ratio": {m: med(m, "ratio") for m in MODES}, "gbps": {m: med(m, "gbps") for m in MODES},
        "kernel_share": {m: med(m, "sys") for m in MODES},
        "pages": {v: {k: {x: statistics.median(c[x] for c in cost[v][k]) for x in ("gbps", "kernel_core_s_per_gb")}
                      for k in ("read", "write")} for v in cost},
        "pages_per_round": cost,
    }  # fmt: skip
    data["adam_ms"] = adam_layouts(a.rounds)
    a.out.write_text(json.dumps(data, indent=2) + "\n")
    print(render(data), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
