"""The planning side of scripts/bench_beyond_memory.py, before the run: where the config's swap files go,
`zoff estimate`'s figures for its policy (in-process, the same functions), whether the disk has room for the
swap files, and the disk's own bandwidth (`zoff bench-io`'s I/O at the config's io setting)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from rich.console import Console

from zoff.config import Config
from zoff.planning.estimate import detect_budget, to_json
from zoff.planning.memory import Estimate, estimate
from zoff.planning.speculation_costs import swap_free_bytes
from zoff.units import human, parse_size


def nvme_sections(cfg: Config) -> dict[str, Path]:
    """The zero.* sections whose device is nvme, each with its swap folder (offload_param falls back to
    offload_optimizer's nvme_path, as the engine does)."""
    out = {}
    oo = cfg.zero.offload_optimizer
    for name in ("offload_optimizer", "offload_param"):
        sec = getattr(cfg.zero, name)
        if getattr(sec, "device", None) == "nvme":
            path = getattr(sec, "nvme_path", None) or oo.nvme_path
            out[name] = Path(path).expanduser()
    return out


def saves_final_checkpoint(cfg: Config) -> bool:
    """zoff train saves a checkpoint at the last step (checkpoint.every_steps 0 = only at the end) unless the
    config can switch checkpoints off; `checkpoint.enabled: false` is the switch this script looks for."""
    return getattr(cfg.checkpoint, "enabled", True) is not False


def configured_row(est_json: dict) -> dict:
    rows = [p for p in est_json["policies"] if p["configured"]]
    if not rows:
        raise SystemExit("bench_beyond_memory: zoff estimate has no row for this config's policy")
    return rows[0]


def configured_estimate(cfg: Config, computed: str) -> tuple[Estimate, dict, dict]:
    """The estimate, in-process (the functions `zoff estimate --json` prints), in the precision the ranks
    compute in (`computed`): (the estimate, its configured policy's row, the JSON's "estimate" field)."""
    budget, device_type = detect_budget(None, None)
    # in the precision the ranks compute in: train.cpu_precision=fp32 builds them in fp32 (the swap files' bytes)
    run_train = dataclasses.replace(cfg.train, precision=computed)
    local = cfg.launch.nproc_per_node
    # (the free disk as the engine will see it: speculation's second slots take the room the swap files leave)
    est = estimate(
        cfg.model,
        cfg.data,
        run_train,
        cfg.zero,
        local,
        1,
        device_type,
        disk_free=swap_free_bytes(cfg.zero) or None,
    )
    est_json = to_json(est, budget, cfg.zero, run_train)
    row = configured_row(est_json)
    # no CUDA: the ranks' "GPU" bytes are host bytes too, so the node's RAM is both columns
    pred_ram = (row["gpu_bytes"] * local if budget.shared else 0) + row["cpu_bytes_per_node"]
    figures = {"policy": row["name"], "ram_bytes": pred_ram, "disk_bytes": row["disk_bytes_per_node"],
               "disk_read_bytes_per_step": row["disk_read_bytes_per_step_per_node"],
               "disk_written_bytes_per_step": row["disk_written_bytes_per_step_per_node"],
               "gpu": row["gpu"], "cpu": row["cpu"], "startup": est_json["startup"],
               "host_budget": row.get("host_budget")}  # fmt: skip
    return est, row, figures


def short_of_room(swap_dirs: list[Path], row: dict, margin: str, result: dict) -> str | None:
    """Whether the swap folders' disk (made if missing) has room for the swap files, the final checkpoint and
    `margin`: its free and needed bytes go into `result`; the message that says why not, or None."""
    for d in swap_dirs:
        d.mkdir(parents=True, exist_ok=True)
    # folders on one device share its free bytes (two devices: the smaller figure, conservatively)
    free = min(shutil.disk_usage(d).free for d in swap_dirs)
    second = (row.get("speculation") or {}).get("second_slot_bytes_per_node", 0)  # (only the room left)
    pred_disk, ckpt_bytes = result["estimate"]["disk_bytes"], result["final_checkpoint_bytes"]
    need = pred_disk - second + ckpt_bytes + parse_size(margin, "--margin")
    result["disk_free_bytes"], result["disk_needed_bytes"] = free, need
    if free >= need:
        return None
    return (
        f"bench_beyond_memory: {swap_dirs[0]} has {human(free)} free; this run needs {human(need)} "
        f"(swap files {human(pred_disk)}"
        + (f", the final checkpoint {human(ckpt_bytes)}" if ckpt_bytes else "")
        + f", margin {margin}): not run"
    )


def disk_bandwidth(io_size: str, swap_root: Path | None, cfg: Config, con: Console) -> dict | None:
    """The disk's own bandwidth at the tier's io setting (io_bandwidth), `io_size` bytes of it; None without a
    swap folder or with --io-size 0."""
    io_bytes = parse_size(io_size, "--io-size") if io_size not in ("0", "") else 0
    if swap_root is None or not io_bytes:
        return None
    io = cfg.zero.offload_optimizer.io
    con.print(f"bench-io on {swap_root}: {human(io_bytes)} at {io.threads} threads x {io.request_mb} MiB ...")
    return io_bandwidth(swap_root, io_bytes, io.threads, io.request_mb)


def io_bandwidth(path: Path, nbytes: int, threads: int, request_mb: int) -> dict:
    """zoff bench-io's measurements at the config's io setting: raw O_DIRECT each way, then the engine's swap."""
    from zoff.planning.bench_io import measure_swap, raw_bandwidth

    work = Path(tempfile.mkdtemp(prefix="zoff-bench-io-", dir=path))
    try:
        raw = raw_bandwidth(work, nbytes, threads, request_mb)
        swap = measure_swap(work, nbytes, threads, request_mb)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "bytes": nbytes,
        "threads": threads,
        "request_mb": request_mb,
        "raw_write_gbps": raw["write"],
        "raw_read_gbps": raw["read"],
        "swap_read_gbps": swap["read"],
        "swap_write_gbps": swap["write"],
    }
