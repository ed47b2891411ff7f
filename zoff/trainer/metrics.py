"""What a run reports: rank 0's console (progress bar or log lines), metrics.jsonl, TensorBoard scalars,
per-rank log files, summary.

Each logged step carries loss, grad_norm, lr, tokens_per_s, step_time_s, rank 0's peak host memory
(peak_rss_mib; on CUDA also peak_alloc_mib) and, where the GPU's peak throughput is known, mfu.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from zoff.trainer.trackers import Trackers


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    """A logger writing to <run_dir>/logs/rank<r>.log (every rank) and, on rank 0, to the console."""
    log = logging.getLogger(f"zoff.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    fh.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
    log.addHandler(fh)
    return log


class MetricsWriter:
    """Rank 0 only: appends one JSON object per logged step to metrics.jsonl and drives the console."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        progress: bool,
        log: logging.Logger,
        *,
        tensorboard: bool = False,
        flops_per_token: float | None = None,
        precision: str | None = None,
        device: torch.device | None = None,
        trackers: Trackers | None = None,
    ):
        """flops_per_token and precision give MFU where the device's peak is known (peak_flops)."""
        self.path = run_dir / "metrics.jsonl"
        # A restart re-runs the steps after its checkpoint (or all of them: a regather restart before the first
        # checkpoint starts at 0), so the old records of those steps go.
        self._truncate_after(start_step)
        self.device = device or _current_device()
        self.peak_flops = peak_flops(self.device, precision)
        self.flops_per_token = flops_per_token
        self.tb = _tensorboard_writer(run_dir, start_step) if tensorboard else None
        self.trackers = trackers
        self.console = Console(stderr=False)
        self.log = log
        self.records: list[dict] = []
        self._steps_seen, self._tokens, self._seconds = 0, 0.0, 0.0
        self.start = time.perf_counter()
        self.live = progress and self.console.is_terminal
        self.bar = None
        if self.live:
            self.bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console,
            )  # fmt: skip
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, info="")
            self.bar.start()

    def step(self, record: dict, write: bool) -> None:
        # Every step's tokens and time, the run's first left out (start-up, compile): the summary's throughput
        # is their ratio. (A mean of logged rates overstated it when step times vary: 1,028 tok/s reported
        # for a run that trained 458.)
        if self._steps_seen:
            self._tokens += record["tokens_per_s"] * record["step_time_s"]
            self._seconds += record["step_time_s"]
        self._steps_seen += 1
        record = {**record, **self._resources(record)}
        info = (
            f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1e3:.0f} ms/step"
        )
        if record.get("grad_norm") is not None:
            info += f"  gnorm {record['grad_norm']:.3f}"
        info += f"  {record['peak_rss_mib']:,.0f} MiB RSS"
        if "peak_alloc_mib" in record:
            info += f"  {record['peak_alloc_mib']:,.0f} MiB GPU"
        if "mfu" in record:
            info += f"  MFU {record['mfu']:.1%}"
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], info=info)
        if write:
            self.records.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self._scalars(record)
            if self.trackers is not None:
                self.trackers.log(record)
            self.log.info("step %d %s", record["step"], info)
            if not self.live:
                print(f"step {record['step']:>6}  {info}", flush=True)

    def _truncate_after(self, step: int) -> None:
        """A resumed run re-runs the steps after its checkpoint: drop their old records, so each step is logged once."""
        if not self.path.is_file():
            return
        keep = [
            ln
            for ln in self.path.read_text().splitlines()
            if ln.strip() and json.loads(ln).get("step", 0) <= step
        ]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        tmp.replace(self.path)

    def event(self, kind: str, step: int, **info) -> None:
        """A run event (resume, preemption) in metrics.jsonl and the log: {"event": kind, "step": step, ...}."""
        record = {"event": kind, "step": step, **info}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.log.info("event %s", json.dumps(record))
        print(f"zoff: {kind} at step {step}" + "".join(f", {k} {v}" for k, v in info.items()), flush=True)

    def _resources(self, record: dict) -> dict:
        """Memory high-water marks (the largest rank's RSS where the loop gathered it, else this process's), and
        MFU where the device's peak is known."""
        out = {"peak_rss_mib": record.get("peak_rss_mib", peak_rss_mib())}
        if self.device.type == "cuda":
            out["peak_alloc_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.peak_flops and self.flops_per_token:
            out["mfu"] = self.flops_per_token * record["tokens_per_s"] / (self.peak_flops * _world())
        return out

    def _scalars(self, record: dict) -> None:
        """The record's numbers as TensorBoard scalars at its step, under the same keys as metrics.jsonl."""
        if self.tb is None:
            return
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, float(v), record["step"])

    def eval(self, step: int, val_loss: float) -> None:
        record = {"step": step, "val_loss": val_loss}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._scalars(record)
        if self.trackers is not None:
            self.trackers.log(record)
        self.records.append(record)
        msg = f"step {step:>6}  val_loss {val_loss:.4f}"
        self.log.info(msg)
        (self.bar.console.print if self.bar is not None else print)(msg)

    def close(self, extra: dict | None = None) -> dict:
        """Write summary.json and print the summary table; `extra` adds the trainer's own figures (memory)."""
        if self.bar is not None:
            self.bar.stop()
        if self.tb is not None:
            self.tb.close()
        train = [r for r in self.records if "loss" in r and "event" not in r]
        val = [r for r in self.records if "val_loss" in r]
        summary = {
            "steps": train[-1]["step"] if train else 0,
            "first_loss": train[0]["loss"] if train else None,
            "final_loss": train[-1]["loss"] if train else None,
            "final_val_loss": val[-1]["val_loss"] if val else None,
            "mean_tokens_per_s": self._tokens / self._seconds
            if self._seconds
            else (
                train[0]["tokens_per_s"] if train else 0  # a one-step run: its only step
            ),
            "train_time_s": time.perf_counter() - self.start,
            "peak_rss_mib": peak_rss_mib(),  # this process's (training passes the largest rank's)
            **(extra or {}),
        }
        (self.path.parent / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.trackers is not None:
            self.trackers.close(summary)
        table = Table(title="zoff run summary", show_header=False)
        for k, v in summary.items():
            table.add_row(k, f"{v:,.4f}" if isinstance(v, float) else str(v))
        self.console.print(table)
        sys.stdout.flush()
        return summary


def peak_rss_mib() -> float:
    """This process's peak RSS so far, MiB (Linux's ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_slots(rank: int, world: int) -> list[float]:
    """This rank's peak RSS in its own slot of a world-long vector, zeros elsewhere: summed over the ranks
    (Comm.sum_scalars) it lists every rank's."""
    return [peak_rss_mib() if r == rank else 0.0 for r in range(world)]


# ------------------------------------------------------------------------------------- MFU and plumbing

# Dense tensor-core peaks per GPU from the vendors' datasheets, TFLOP/s: (bf16/fp16, fp32 via TF32 or plain).
# Matched by substring of torch.cuda.get_device_name, most specific first.
GPU_PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756.0, 378.0), ("H100", 989.0, 494.0), ("H200", 989.0, 494.0), ("GH200", 989.0, 494.0),
    ("B200", 2250.0, 1100.0), ("A100", 312.0, 156.0), ("L40S", 362.0, 183.0), ("L4", 121.0, 60.0),
    ("A6000", 155.0, 77.4), ("RTX 4090", 165.0, 82.6), ("RTX 3090", 71.0, 35.6), ("V100", 125.0, 15.7),
    ("T4", 65.0, 8.1),
)  # fmt: skip


def peak_flops(device: torch.device, precision: str | None) -> float | None:
    """The device's peak FLOP/s for the run's precision, or None where it is not known (every CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, half, single in GPU_PEAK_TFLOPS:
        if key in name:
            return (single if precision in (None, "fp32") else half) * 1e12
    return None


def _tensorboard_writer(run_dir: Path, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from zoff.errors import UserError

        raise UserError(
            "log.tensorboard: needs the tensorboard package: pip install zoff[tensorboard]"
        ) from None
    # A resumed run re-runs the steps after its checkpoint: purge_step drops their old events.
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)


def _current_device() -> torch.device:
    if torch.cuda.is_available():  # the launcher has set this rank's device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
