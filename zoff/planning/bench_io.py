"""`zoff bench-io PATH`: what the disk tier can expect from a path, measured with the tier's own I/O.

For a few (threads, request size) settings: sequential O_DIRECT write then read of a file through
disk.swapfile.SwapFile, the engine's I/O alone; then the engine's swap of whole units (state_swap.SwappedStates: in,
out, and both overlapping as in a step) at the best setting. Prints them side by side with the `io:` setting to use.
scripts/bench_nvme.py adds dd as an outside reference and the optimizer step.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from zoff.engine.disk.state_swap import SwappedStates
from zoff.engine.disk.swapfile import AlignedBuffer, SwapFile, aligned, filesystem_type, wait
from zoff.errors import UserError
from zoff.host.cache import cache_dir

SETTINGS = ((1, 1), (4, 1), (4, 8), (8, 8), (8, 32))  # (threads, request MiB)


def raw_bandwidth(folder: Path, nbytes: int, threads: int, request_mb: int) -> dict[str, float]:
    """Write then read `nbytes` sequentially with the engine's I/O: GB/s each way (the write fsynced).

    The timed write overwrites data already written, as a swap file is after its first step: the first
    write into fallocated space also converts the filesystem's extents, slower, and would flatter the
    engine's steady state compared with it. The read reads written data (unwritten extents read as zeros
    without touching the disk)."""
    nbytes = aligned(nbytes)
    f = SwapFile(folder / "bench-io.swap", nbytes, threads, request_mb << 20)
    buf = AlignedBuffer(min(nbytes, 256 << 20))
    buf.bytes.fill_(7)
    out = {}
    try:
        for kind, op in (("fill", f.write), ("write", f.write), ("read", f.read)):
            t0 = time.perf_counter()
            for off in range(0, nbytes, buf.nbytes):
                wait(op(buf.bytes[: min(buf.nbytes, nbytes - off)], off))
            if kind != "read":
                os.fsync(f.fd)
            out[kind] = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        f.close()
    return out


def swap_bandwidth(states: SwappedStates) -> dict[str, float]:
    """The tier's own swap throughput over every piece, no compute, in GB/s: swap-in alone (reads with
    read-ahead), swap-out alone, and both as a step does them (each piece read, then written back while the
    next is read). 'both' counts the bytes of the two directions together."""
    out = {}
    for kind, read, write in (("read", True, False), ("write", False, True), ("both", True, True)):
        moved0 = states.file.read_bytes + states.file.written_bytes
        t0 = time.perf_counter()
        states.stream(read, write)
        if write:
            os.fsync(states.file.fd)
        dt = time.perf_counter() - t0
        moved = states.file.read_bytes + states.file.written_bytes - moved0
        out[kind] = moved / dt / 1e9
        if kind == "both":
            out["seconds"], out["bytes"] = dt, moved
    return out


def measure_swap(
    folder: Path, nbytes: int, threads: int, request_mb: int, unit_params: int = 8 << 20
) -> dict:
    """swap_bandwidth of a tier holding `nbytes` of states in units of `unit_params`, its swap file in
    `folder` (removed after)."""
    numel = nbytes // 12
    shards = [torch.zeros(min(unit_params, numel - a)) for a in range(0, numel, unit_params)]
    states = SwappedStates(
        shards, folder, lambda s, d: d.copy_(s), threads=threads, request_bytes=request_mb << 20
    )
    try:
        return swap_bandwidth(states)
    finally:
        states.close()


def run(path: Path, nbytes: int, unit_params: int = 8 << 20) -> list[str]:
    """Measure `path`; the lines to print (a table and the suggested setting)."""
    if not path.is_dir():
        raise UserError(f"PATH: {path} is not a folder")
    if shutil.disk_usage(path).free < 2 * nbytes:
        raise UserError(f"PATH: {path} has less than {2 * nbytes:,} bytes free for the measurement (--size)")
    work = Path(tempfile.mkdtemp(prefix="zoff-bench-io-", dir=path))
    lines = [f"zoff bench-io {path} ({filesystem_type(path)}), {nbytes / 2**30:.1f} GiB per measurement"]
    try:
        results = []
        for threads, mb in SETTINGS:
            r = raw_bandwidth(work, nbytes, threads, mb)
            results.append((threads, mb, r))
            lines.append(
                f"  raw O_DIRECT  threads {threads:2d} x {mb:2d} MiB: write {r['write']:6.2f} GB/s, read {r['read']:6.2f} GB/s"
            )
        threads, mb, best = max(results, key=lambda x: x[2]["read"] + x[2]["write"])
        sw = measure_swap(work, nbytes, threads, mb, unit_params)
        lines.append(
            f"  engine swap   threads {threads:2d} x {mb:2d} MiB: write {sw['write']:6.2f} GB/s, read {sw['read']:6.2f} GB/s "
            f"({sw['write'] / best['write']:.0%} and {sw['read'] / best['read']:.0%} of raw); as a step overlaps "
            f"them, {sw['both']:.2f} GB/s both ways together"
        )
        lines.append(
            f"suggested: zero.offload_optimizer.io.threads={threads} zero.offload_optimizer.io.request_mb={mb}"
        )
        record = {"path": str(path), "filesystem": filesystem_type(path), "read_gbps": best["read"],
                  "write_gbps": best["write"], "swap_read_gbps": sw["read"], "swap_write_gbps": sw["write"], "threads": threads,
                  "request_mb": mb, "measured_at": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
        lines.append(
            f"saved for `zoff estimate` (disk time per step on this filesystem): {_save(path, record)}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lines


# ---------------------------------------------------------------------------- the last measurement, kept
DEFAULT_GBPS = 1.0  # each way, when a filesystem was never measured: a SATA SSD's order, stated as assumed


def _store() -> Path:
    return cache_dir() / "bench-io.json"


def _save(path: Path, record: dict) -> Path:
    """Keep the measurement under the filesystem's device id: every path on that filesystem shares it."""
    store = _store()
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    known[str(os.stat(path).st_dev)] = record
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = store.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, store)
    return store


def disk_bandwidth(path: str | None) -> tuple[float, float, str]:
    """(read GB/s, write GB/s, where they come from) for the filesystem holding `path`: the last `zoff
    bench-io` of it, else DEFAULT_GBPS each way, said to be assumed."""
    try:
        known = json.loads(_store().read_text())
        rec = known[str(os.stat(Path(path).expanduser()).st_dev)]
        return rec["read_gbps"], rec["write_gbps"], f"zoff bench-io {rec['path']}, {rec['measured_at']}"
    except (OSError, ValueError, KeyError, TypeError):
        return (
            DEFAULT_GBPS,
            DEFAULT_GBPS,
            f"assumed {DEFAULT_GBPS:g} GB/s each way: run `zoff bench-io` on it",
        )
