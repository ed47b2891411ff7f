#!/usr/bin/env python
"""Train a model whose states do not fit in RAM, and measure what the job really used (issue 18's demonstration).

Not a test. In one run: check the disk has room for the run's swap files (exit 0 with a message when it has
not), take `zoff estimate`'s figures for the configured policy (in-process, the same functions), measure the
swap path with `zoff bench-io`'s own I/O at the config's io setting, then run `zoff train` on the config as a
subprocess and sample every --interval seconds, from /proc: the RSS of the launcher and of every descendant
(the ranks, labelled by the rank log each holds open), their sum, the page cache (Cached) against its level
before the run, the swap files' size, and the disk bytes the ranks read and wrote (/proc/<pid>/io, and the
device's /proc/diskstats, which counts every process on the machine). Afterwards it reads the run's
metrics.jsonl and rank logs and prints one table (parameters, model-state bytes against RAM, peak RSS, page
cache, disk traffic per step and GB/s against bench-io, step time split, loss per step, estimate vs measured)
and writes it all to JSON.

    python scripts/bench_beyond_memory.py                       # configs/gpt-3b-nvme.yaml: 3.4B params, ~50 GB disk
    python scripts/bench_beyond_memory.py --size 1b --steps 3 --path /var/tmp/zoff-swap
    python scripts/bench_beyond_memory.py --size tiny --steps 3 --io-size 64MiB
    python scripts/bench_beyond_memory.py --config my-hf.yaml --size tiny [KEY.PATH=VALUE ...]

--size sets model.n_layer / n_head / d_model (an hf: model maps them onto its config); without it the config's
own model is used. Trailing KEY.PATH=VALUE overrides go to `zoff estimate` and `zoff train` alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zoff.config import CONFIGS_DIR, Config, load_config
from zoff.engine.policy import data_parallel_bytes
from zoff.planning.estimate import detect_budget, to_json
from zoff.planning.memory import estimate
from zoff.units import human, parse_size

# model.* of each --size (64-wide heads); parameters of the builtin GPT at vocab 256, seq_len 128
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "d_model": 256},  # 1.7M
    "100m": {"n_layer": 12, "n_head": 12, "d_model": 768},  # 85M
    "1b": {"n_layer": 20, "n_head": 16, "d_model": 2048},  # 1.0B
    "3b": {"n_layer": 30, "n_head": 24, "d_model": 3072},  # 3.4B
}
DEFAULT_CONFIG = CONFIGS_DIR / "gpt-3b-nvme.yaml"
GB = 1e9


# ----------------------------------------------------------------------------------------------- /proc


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:  # the process ended, or is not ours
        return None


def children_map() -> dict[int, list[int]]:
    """ppid -> pids, over every process visible now."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if stat is None:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the command name may hold spaces and parens
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(root: int) -> list[int]:
    kids, out, todo = children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def proc_status(pid: int) -> dict[str, int] | None:
    """VmRSS and VmHWM (bytes) of a process, None once it is gone."""
    text = _read(f"/proc/{pid}/status")
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line[:5]] = int(line.split()[1]) * 1024
    return out if "VmRSS" in out else None


def proc_io(pid: int) -> dict[str, int] | None:
    """read_bytes / write_bytes: what the process (all its threads) made the storage layer move, O_DIRECT included."""
    text = _read(f"/proc/{pid}/io")
    if text is None:
        return None
    kv = dict(line.split(": ") for line in text.splitlines() if ": " in line)
    return {"read": int(kv.get("read_bytes", 0)), "write": int(kv.get("write_bytes", 0))}


RANK_LOG = re.compile(r"/logs/rank(\d+)\.log$")


def role_of(pid: int, launcher: int) -> str:
    """launcher, rank<r> (by the rank log it holds open, logs/rank<r>.log) or the command's name."""
    if pid == launcher:
        return "launcher"
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                m = RANK_LOG.search(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if m:
                return f"rank{m.group(1)}"
    except OSError:
        pass
    cmd = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ")
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return "worker" if "multiprocessing" in cmd else "other"


def block_device(path: Path) -> str | None:
    """The /proc/diskstats name of the device holding `path` (None for tmpfs, overlay without a device, ...)."""
    st = os.stat(path)
    link = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return link.resolve().name if link.exists() else None


def diskstats(dev: str | None) -> dict[str, int] | None:
    """Bytes read and written by the device since boot (sectors of 512 B), every process on the machine."""
    if dev is None:
        return None
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] == dev:
            return {"read": int(f[5]) * 512, "write": int(f[9]) * 512}
    return None


def tree_bytes(paths: list[Path]) -> int:
    """Allocated bytes of every file under `paths` (the swap files)."""
    total = 0
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def import_baseline_rss() -> int:
    """VmRSS of a fresh interpreter that imported what a rank imports: the part of a rank's RSS the estimate
    does not count (interpreter, torch, zoff)."""
    code = (
        "import torch, torch.distributed, zoff.trainer.session, zoff.launch, pathlib;"
        "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmRSS:')][0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[1]) * 1024


# -------------------------------------------------------------------------------------------- planning


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


# ------------------------------------------------------------------------------------------------- run


class Sampler:
    """Everything sampled from /proc while the job runs: RSS per process and summed, page cache, swap files,
    disk bytes of the ranks and of the device, and the cumulative counters at each step record.

    Peaks are kept per phase: "train" (start-up and every step, until the last step's record appears) and
    "end" (the final evaluation, the checkpoint zoff train saves at the last step, exit)."""

    def __init__(self, launcher: int, swap_dirs: list[Path], dev: str | None, metrics: Path, max_steps: int):
        self.launcher, self.swap_dirs, self.dev, self.metrics = launcher, swap_dirs, dev, metrics
        self.max_steps = max_steps
        self.cached0 = meminfo()["Cached"]
        self.disk0 = diskstats(dev)
        self.t0 = time.perf_counter()
        self.phase = "train"
        self.roles: dict[int, str] = {}
        self.hwm: dict[int, int] = {}  # the kernel's own high-water mark (whole life), last seen
        self.io: dict[int, dict[str, int]] = {}  # last seen per pid (kept after it exits)
        self.peaks = {ph: {"job": 0, "ranks": 0, "cache": 0, "swap": 0, "rss": {}} for ph in ("train", "end")}
        self.series: list[list] = []  # [t, phase, job RSS, ranks RSS, page-cache growth, swap bytes]
        self.samples = 0
        self.snapshots: list[dict] = []  # at each new step record: cumulative counters
        self.records: list[dict] = []
        self._lines = 0

    def io_total(self) -> dict[str, int]:
        ranks = [p for p, r in self.roles.items() if r.startswith("rank") or r == "worker"]
        return {k: sum(self.io[p][k] for p in ranks if p in self.io) for k in ("read", "write")}

    def sample(self) -> None:
        pk = self.peaks[self.phase]
        job = ranks = 0
        for pid in descendants(self.launcher):
            st = proc_status(pid)
            if st is None:
                continue
            role = self.roles.get(pid)
            if role is None or role in ("worker", "other"):  # a rank opens its log a little after it starts
                self.roles[pid] = role = role_of(pid, self.launcher)
            pk["rss"][pid] = max(pk["rss"].get(pid, 0), st["VmRSS"])
            self.hwm[pid] = st.get("VmHWM", 0)
            job += st["VmRSS"]
            ranks += st["VmRSS"] if role.startswith("rank") else 0
            io = proc_io(pid)
            if io is not None:
                self.io[pid] = io
        cache = meminfo()["Cached"] - self.cached0
        swap = tree_bytes(self.swap_dirs)
        for key, v in (("job", job), ("ranks", ranks), ("cache", cache), ("swap", swap)):
            pk[key] = max(pk[key], v)
        self.series.append([round(time.perf_counter() - self.t0, 2), self.phase, job, ranks, cache, swap])
        self.samples += 1
        self._read_metrics()

    def _read_metrics(self) -> None:
        if not self.metrics.is_file():
            return
        lines = self.metrics.read_text().splitlines()
        new = [json.loads(ln) for ln in lines[self._lines :] if ln.strip() and ln.endswith("}")]
        self._lines += len(new)
        steps = [r for r in new if "loss" in r and "event" not in r]
        self.records.extend(new)
        if steps:
            self.snapshots.append(
                {"step": steps[-1]["step"], "t": time.perf_counter() - self.t0, "ranks_io": self.io_total(),
                 "device_io": diskstats(self.dev)}
            )  # fmt: skip
            if steps[-1]["step"] >= self.max_steps:
                self.phase = "end"

    def peak(self, key: str, phase: str | None = None) -> int:
        return max(self.peaks[ph][key] for ph in ([phase] if phase else self.peaks))

    def per_process(self) -> list[dict]:
        pids = sorted(set(self.peaks["train"]["rss"]) | set(self.peaks["end"]["rss"]))
        return [
            {"pid": p, "role": self.roles.get(p, "?"),
             "peak_rss_train_bytes": self.peaks["train"]["rss"].get(p, 0),
             "peak_rss_bytes": max(self.peaks[ph]["rss"].get(p, 0) for ph in self.peaks),
             "vm_hwm_bytes": self.hwm.get(p, 0), "read_bytes": self.io.get(p, {}).get("read", 0),
             "write_bytes": self.io.get(p, {}).get("write", 0)}
            for p in pids
        ]  # fmt: skip


def per_step_io(snaps: list[dict], key: str) -> dict | None:
    """Bytes per step between the first and the last snapshot that are steps apart (steps 2.. when sampled
    finely enough: start-up's writes of the initial states fall before the first step record)."""
    snaps = [s for s in snaps if s.get(key) is not None]
    if len(snaps) < 2 or snaps[-1]["step"] == snaps[0]["step"]:
        return None
    a, b = snaps[0], snaps[-1]
    n = b["step"] - a["step"]
    return {
        "steps": n,
        "from_step": a["step"],
        "to_step": b["step"],
        "read_per_step": (b[key]["read"] - a[key]["read"]) / n,
        "write_per_step": (b[key]["write"] - a[key]["write"]) / n,
        "seconds_per_step": (b["t"] - a["t"]) / n,
    }


def engine_stats(run_dir: Path) -> dict[str, dict]:
    """The 'engine stats' line each rank logs at the end (its last step's optimizer/publish times)."""
    out = {}
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        for line in log.read_text().splitlines():
            if " engine stats " in line:
                out[log.stem] = json.loads(line.split(" engine stats ", 1)[1])
    return out


def pct(measured: float, predicted: float) -> float | None:
    return None if not predicted else 100.0 * (measured - predicted) / predicted


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="any zoff config (builtin GPT or hf:)"
    )
    ap.add_argument("--size", choices=sorted(SIZES), help="model.n_layer/n_head/d_model preset")
    ap.add_argument("--steps", type=int, help="train.max_steps (default: the config's)")
    ap.add_argument(
        "--path", type=Path, help="the swap folder (default: the config's nvme_path); made if missing"
    )
    ap.add_argument("--nproc", type=int, help="ranks (launch.nproc_per_node)")
    ap.add_argument("--json", type=Path, default=Path("runs/bench/bench_beyond_memory.json"), dest="out")
    ap.add_argument(
        "--run-dir", type=Path, help="zoff train's run directory (default runs/bench/beyond-memory-<time>)"
    )
    ap.add_argument("--io-size", default="1GiB", help="bytes of the bench-io measurement (0: skip it)")
    ap.add_argument("--margin", default="2GiB", help="free disk kept beyond the swap files (and checkpoint)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between /proc samples")
    ap.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE overrides for estimate and train")
    return ap.parse_args(argv)


def build_overrides(a: argparse.Namespace) -> list[str]:
    out = [f"model.{k}={v}" for k, v in SIZES.get(a.size or "", {}).items()]
    if a.steps is not None:
        out.append(f"train.max_steps={a.steps}")
    if a.nproc is not None:
        out.append(f"launch.nproc_per_node={a.nproc}")
    out.append("train.log_every=1")  # a record per step: its loss and its time
    out += a.overrides
    if a.path is not None:  # both sections (offload_param falls back to the optimizer's path anyway)
        out += [f"zero.{sec}.nvme_path={a.path}" for sec in ("offload_optimizer", "offload_param")]
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    con = Console(width=max(Console().width, 150))
    overrides = build_overrides(a)
    cfg = load_config(a.config, overrides)
    sections = nvme_sections(cfg)
    if not sections:
        con.print(
            "[yellow]warning: this config keeps nothing on disk (no zero.*.device nvme): no disk tier to measure"
        )
    swap_dirs = sorted(set(sections.values()))
    swap_root = swap_dirs[0] if swap_dirs else None
    mem = meminfo()
    local = cfg.launch.nproc_per_node

    # ---- the estimate, in-process: the functions `zoff estimate --json` prints
    budget, device_type = detect_budget(None, None)
    est = estimate(cfg.model, cfg.data, cfg.train, cfg.zero, local, 1, device_type)
    est_json = to_json(est, budget, cfg.zero, cfg.train)
    row = configured_row(est_json)
    # no CUDA: the ranks' "GPU" bytes are host bytes too, so the node's RAM is both columns
    pred_ram = (row["gpu_bytes"] * local if budget.shared else 0) + row["cpu_bytes_per_node"]
    pred_disk = row["disk_bytes_per_node"]
    states = data_parallel_bytes(est.trainable_params)
    ckpt_bytes = 12 * est.trainable_params if saves_final_checkpoint(cfg) else 0  # fp32 master + 2 moments
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip() or None,
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "mem_total_bytes": mem["MemTotal"],
                    "python": platform.python_version()},
        "config": str(a.config), "size": a.size, "overrides": overrides, "nproc": local,
        "params": est.params, "trainable_params": est.trainable_params, "precision": cfg.train.precision,
        "model_state_bytes": states, "model_state_to_ram": states / mem["MemTotal"],
        "nvme_sections": {k: str(v) for k, v in sections.items()}, "swap_paths": [str(d) for d in swap_dirs],
        "estimate": {"policy": row["name"], "ram_bytes": pred_ram, "disk_bytes": pred_disk,
                     "disk_read_bytes_per_step": row["disk_read_bytes_per_step_per_node"],
                     "disk_written_bytes_per_step": row["disk_written_bytes_per_step_per_node"],
                     "gpu": row["gpu"], "cpu": row["cpu"], "startup": est_json["startup"]},
        "final_checkpoint_bytes": ckpt_bytes,
    }  # fmt: skip

    # ---- room on the disk first
    if swap_root is not None:
        for d in swap_dirs:
            d.mkdir(parents=True, exist_ok=True)
        # folders on one device share its free bytes (two devices: the smaller figure, conservatively)
        free = min(shutil.disk_usage(d).free for d in swap_dirs)
        need = pred_disk + ckpt_bytes + parse_size(a.margin, "--margin")
        result["disk_free_bytes"], result["disk_needed_bytes"] = free, need
        if free < need:
            msg = (
                f"bench_beyond_memory: {swap_root} has {human(free)} free; this run needs {human(need)} "
                f"(swap files {human(pred_disk)}"
                + (f", the final checkpoint {human(ckpt_bytes)}" if ckpt_bytes else "")
                + f", margin {a.margin}): not run"
            )
            con.print(msg)
            result["status"] = "no room"
            _write(a.out, result, con)
            return 0

    # ---- the disk's own bandwidth, with the tier's I/O at the config's setting
    io_bytes = parse_size(a.io_size, "--io-size") if a.io_size not in ("0", "") else 0
    if swap_root is not None and io_bytes:
        io = cfg.zero.offload_optimizer.io
        con.print(
            f"bench-io on {swap_root}: {human(io_bytes)} at {io.threads} threads x {io.request_mb} MiB ..."
        )
        result["bench_io"] = io_bandwidth(swap_root, io_bytes, io.threads, io.request_mb)
    baseline = import_baseline_rss()
    result["import_baseline_rss_bytes"] = baseline

    # ---- the run
    run_dir = a.run_dir or Path("runs/bench") / f"beyond-memory-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "zoff", "train", str(a.config), *overrides, "--run-dir", str(run_dir)]
    con.print("running: " + " ".join(cmd))
    dev = block_device(swap_root) if swap_root else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    sampler = Sampler(proc.pid, swap_dirs, dev, run_dir / "metrics.jsonl", cfg.train.max_steps)
    while proc.poll() is None:
        sampler.sample()
        time.sleep(a.interval)
    sampler.sample()  # the last lines of metrics.jsonl
    wall = time.perf_counter() - t0
    result["returncode"], result["wall_s"], result["run_dir"] = proc.returncode, wall, str(run_dir)
    result["status"] = "ok" if proc.returncode == 0 else "failed"
    result.update(measure(sampler, run_dir, result, baseline))
    render(con, result)
    _write(a.out, result, con)
    return 0 if proc.returncode == 0 else 1


SPLIT = (  # (key, label): the parts of a step, from rank 0's records in metrics.jsonl
    ("compute_s", "forward/backward compute (and everything else)"),
    ("param_read_wait_s", "waiting for parameter shards read from disk (gathers)"),
    ("optimizer_disk_wait_s", "optimizer: waiting for its states' reads and writes"),
    ("adam_s", "optimizer: CPU Adam and conversions"),
    ("param_write_wait_s", "optimizer: waiting for parameter write-backs"),
    ("publish_s", "publish (all-gather of persistent params, last write-back)"),
)


def step_split(steps: list[dict]) -> dict:
    """Median seconds of each part of a step over `steps` (metrics.jsonl records carry the engine's timings
    and swap-file waits); empty without them."""
    if not steps or "optimizer_s" not in steps[0]:
        return {}
    parts: dict[str, list[float]] = {k: [] for k, _ in SPLIT}
    for x in steps:
        read_wait = x.get("disk_params_read_wait_s", 0.0)
        param_write = x.get("disk_params_wait_s", 0.0) - read_wait
        opt_wait = x.get("disk_optimizer_wait_s", 0.0)
        parts["compute_s"].append(x["step_time_s"] - x["optimizer_s"] - x["publish_s"] - read_wait)
        parts["param_read_wait_s"].append(read_wait)
        parts["optimizer_disk_wait_s"].append(opt_wait)
        parts["adam_s"].append(x["optimizer_s"] - opt_wait - param_write)
        parts["param_write_wait_s"].append(param_write)
        parts["publish_s"].append(x["publish_s"])
    return {
        "steps": [x["step"] for x in steps],
        **{k: statistics.median(v) for k, v in parts.items()},
        "note": "medians over the steps listed, rank 0; compute is the step less the rest",
    }


def measure(s: Sampler, run_dir: Path, r: dict, baseline: int) -> dict:
    """The measured side of the table from the sampler, metrics.jsonl and the rank logs."""
    steps = [x for x in s.records if "loss" in x and "event" not in x]
    procs = s.per_process()
    ranks = sorted((p for p in procs if p["role"].startswith("rank")), key=lambda p: int(p["role"][4:]))
    launcher = next((p for p in procs if p["role"] == "launcher"), None)
    stats = engine_stats(run_dir)
    ranks_io, device_io = per_step_io(s.snapshots, "ranks_io"), per_step_io(s.snapshots, "device_io")
    times = [x["step_time_s"] for x in steps]
    steady = times[1:] or times
    split = step_split(steps[1:] or steps)
    io_measured = {}
    for name, src in (("ranks", ranks_io), ("device", device_io)):
        if src is not None:
            sec = src["seconds_per_step"] or None
            io_measured[name] = {
                **src,
                "read_gbps_over_step": src["read_per_step"] / sec / GB if sec else None,
                "write_gbps_over_step": src["write_per_step"] / sec / GB if sec else None,
            }
    est = r["estimate"]
    growth = s.peak("ranks", "train") - len(ranks) * baseline
    mem_total = r["machine"]["mem_total_bytes"]
    per_step = lambda key: ranks_io[key] if ranks_io else None  # noqa: E731
    return {
        "samples": s.samples,
        "processes": procs,
        "peak_rss_per_rank_bytes": {p["role"]: p["peak_rss_train_bytes"] for p in ranks},
        "peak_rss_launcher_bytes": launcher["peak_rss_bytes"] if launcher else 0,
        "peak_rss_job_bytes": s.peak("job", "train"),
        "peak_rss_job_to_ram": s.peak("job", "train") / mem_total,
        "peak_rss_ranks_bytes": s.peak("ranks", "train"),
        "peak_rss_ranks_above_import_baseline_bytes": growth,
        "page_cache_growth_bytes": s.peak("cache", "train"),
        "end_phase": {  # the final evaluation and the checkpoint zoff train saves at the last step
            "peak_rss_job_bytes": s.peaks["end"]["job"],
            "peak_rss_per_rank_bytes": {p["role"]: max(p["peak_rss_bytes"], p["vm_hwm_bytes"]) for p in ranks},
            "page_cache_growth_bytes": s.peaks["end"]["cache"],
        },
        "swap_files_peak_bytes": s.peak("swap"),
        "ranks_io_total": {k: sum(p[f"{k}_bytes"] for p in ranks) for k in ("read", "write")},
        "disk_io_per_step": io_measured,
        "steps": [{k: x.get(k) for k in ("step", "loss", "step_time_s", "grad_norm", "lr", "peak_rss_mib")}
                  for x in steps],  # fmt: skip
        "val_loss": next((x["val_loss"] for x in reversed(s.records) if "val_loss" in x), None),
        "step_time_median_s": statistics.median(steady) if steady else None,
        "step_time_split": split,
        "engine_stats": stats,
        "series": {"columns": ["t_s", "phase", "job_rss", "ranks_rss", "page_cache_growth", "swap_bytes"],
                   "rows": s.series},  # fmt: skip
        "vs_estimate": {
            "ram_bytes": {"predicted": est["ram_bytes"], "measured": growth, "diff_pct": pct(growth, est["ram_bytes"]),
                          "measured_is": "the ranks' summed peak RSS during training less their import baseline"},
            "disk_bytes": {"predicted": est["disk_bytes"], "measured": s.peak("swap"),
                           "diff_pct": pct(s.peak("swap"), est["disk_bytes"])},
            "disk_read_per_step": {"predicted": est["disk_read_bytes_per_step"], "measured": per_step("read_per_step"),
                                   "diff_pct": pct(per_step("read_per_step") or 0, est["disk_read_bytes_per_step"]) if ranks_io else None},
            "disk_written_per_step": {"predicted": est["disk_written_bytes_per_step"], "measured": per_step("write_per_step"),
                                      "diff_pct": pct(per_step("write_per_step") or 0, est["disk_written_bytes_per_step"]) if ranks_io else None},
        },
        "missing_from_trainer": MISSING,
    }  # fmt: skip


MISSING = [
    "every rank's peak RSS per step (metrics.jsonl carries rank 0's only; this script samples /proc instead)",
]


def render(con: Console, r: dict) -> None:
    b = lambda x: "-" if x is None else human(int(x))  # noqa: E731
    p = lambda x: "-" if x is None else f"{x:+.1f}%"  # noqa: E731
    gbs = lambda x: "-" if x is None else f"{x:.2f} GB/s"  # noqa: E731
    title = (
        f"zoff beyond memory: {Path(r['config']).name}{' --size ' + r['size'] if r['size'] else ''}, "
        f"{r['nproc']} rank(s), {r['precision']}, {r['estimate']['policy']}, {r['date']}"
    )
    tab = Table(title=title)
    for col in ("", "measured", "zoff estimate", "diff"):
        tab.add_column(col, justify="left" if not col else "right")
    ram = r["machine"]["mem_total_bytes"]
    tab.add_row("parameters", f"{r['params']:,}", "", "")
    tab.add_row("model-state bytes (16 B/param)", b(r["model_state_bytes"]), "", "")
    tab.add_row("total RAM (MemTotal)", b(ram), "", "")
    tab.add_row("model states / RAM", f"{r['model_state_to_ram']:.2f}x", "", "")
    for role, v in r["peak_rss_per_rank_bytes"].items():
        tab.add_row(f"peak RSS {role} (training)", b(v), "", "")
    tab.add_row("peak RSS launcher", b(r["peak_rss_launcher_bytes"]), "", "")
    tab.add_row(
        "peak RSS whole job (sum, training)",
        f"{b(r['peak_rss_job_bytes'])} ({r['peak_rss_job_to_ram']:.1%} of RAM)",
        "",
        "",
    )
    v = r["vs_estimate"]["ram_bytes"]
    tab.add_row(f"ranks' RSS less import baseline ({b(r['import_baseline_rss_bytes'])}/rank)",
                b(v["measured"]), b(v["predicted"]), p(v["diff_pct"]))  # fmt: skip
    tab.add_row("page-cache growth (peak, training)", b(r["page_cache_growth_bytes"]), "", "")
    end = r["end_phase"]
    tab.add_row("after the last step (eval, checkpoint): peak RSS job / page cache",
                f"{b(end['peak_rss_job_bytes'])} / {b(end['page_cache_growth_bytes'])}", "", "")  # fmt: skip
    v = r["vs_estimate"]["disk_bytes"]
    tab.add_row("swap files on disk (peak)", b(v["measured"]), b(v["predicted"]), p(v["diff_pct"]))
    bio = r.get("bench_io") or {}
    for key, label in (("read", "read"), ("write", "written")):
        v = r["vs_estimate"][f"disk_{label}_per_step"]
        tab.add_row(
            f"disk bytes {label} per step (ranks)", b(v["measured"]), b(v["predicted"]), p(v["diff_pct"])
        )
        for src in ("ranks", "device"):
            io = r["disk_io_per_step"].get(src)
            if io:
                tab.add_row(f"  {src}: {key} GB/s over the step / bench-io raw",
                            gbs(io[f"{key}_gbps_over_step"]), gbs(bio.get(f"raw_{key}_gbps")), "")  # fmt: skip
    if bio:
        sw = f"{gbs(bio['swap_write_gbps'])} / {gbs(bio['swap_read_gbps'])}"
        tab.add_row("bench-io engine swap-out / swap-in", sw, "", "")
    med = r["step_time_median_s"]
    tab.add_row("step time (median of steps 2..)", f"{med:.2f} s" if med is not None else "-", "", "")
    sp = r["step_time_split"]
    for key, label in SPLIT if sp else ():
        tab.add_row(f"  {label}", f"{sp[key]:.2f} s", "", "")
    tab.add_row("loss per step", " ".join(f"{x['loss']:.3f}" for x in r["steps"]), "", "")
    if r.get("val_loss") is not None:
        tab.add_row("final val loss", f"{r['val_loss']:.3f}", "", "")
    con.print(tab)


def _cpu_name() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _write(out: Path, result: dict, con: Console) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    con.print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
