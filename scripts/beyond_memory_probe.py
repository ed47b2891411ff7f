"""The measuring side of scripts/bench_beyond_memory.py: what it reads from /proc (RSS and high-water mark per
process, page cache, disk bytes per process and per device, the swap files' size, which rank a process is)
and the Sampler that polls them while `zoff train` runs, with the cumulative counters at each step record."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

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
    """Data bytes allocated to every file under `paths` (the swap files): the blocks a file holds, but no more
    than its size. ext4 counts an extent-tree block in st_blocks when a file lies in many pieces (a busy disk
    fragments it), which is the filesystem's metadata, not the file's data the estimate plans."""
    total = 0
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except OSError:
                    continue
                total += min(st.st_blocks * 512, -(-st.st_size // 4096) * 4096)
    return total


def import_baseline_rss() -> int:
    """VmRSS of a fresh interpreter that imported what a rank imports: the part of a rank's RSS the estimate
    does not count (interpreter, torch, zoff)."""
    code = (
        "import torch, torch.distributed, zoff.trainer.run, zoff.launch.elastic, pathlib;"
        "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmRSS:')][0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[1]) * 1024


def cpu_name() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


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
