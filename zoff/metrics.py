"""What a run reports: rank 0's console (progress bar or log lines), metrics.jsonl, per-rank log files, summary."""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


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

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress: bool, log: logging.Logger):
        self.path = run_dir / "metrics.jsonl"
        if start_step > 0:
            self._truncate_after(start_step)
        self.console = Console(stderr=False)
        self.log = log
        self.records: list[dict] = []
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
        info = (
            f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1e3:.0f} ms/step"
        )
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], info=info)
        if write:
            self.records.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
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

    def eval(self, step: int, val_loss: float) -> None:
        record = {"step": step, "val_loss": val_loss}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        msg = f"step {step:>6}  val_loss {val_loss:.4f}"
        self.log.info(msg)
        (self.bar.console.print if self.bar is not None else print)(msg)

    def close(self) -> dict:
        if self.bar is not None:
            self.bar.stop()
        train = [r for r in self.records if "loss" in r and "event" not in r]
        val = [r for r in self.records if "val_loss" in r]
        summary = {
            "steps": train[-1]["step"] if train else 0,
            "first_loss": train[0]["loss"] if train else None,
            "final_loss": train[-1]["loss"] if train else None,
            "final_val_loss": val[-1]["val_loss"] if val else None,
            "mean_tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in train[1:] or train)
            if train
            else 0,
            "train_time_s": time.perf_counter() - self.start,
        }
        (self.path.parent / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        table = Table(title="zoff run summary", show_header=False)
        for k, v in summary.items():
            table.add_row(k, f"{v:,.4f}" if isinstance(v, float) else str(v))
        self.console.print(table)
        sys.stdout.flush()
        return summary
