"""What `zoff train` says when a run ends or restarts: the checkpoint really on disk (read from the directory
now, never assumed from what was asked) and the command line that continues the run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zoff.config import Config
from zoff.trainer import regather

if TYPE_CHECKING:
    from zoff.checkpoint.status import OnDisk


def regather_lines(cfg: Config, again: Config, out: Path, ckpt_dir: Path) -> str:
    """What a restart for skipped stage-3 blocks says: why, what changes, and from where it continues."""
    from zoff.checkpoint.status import latest_on_disk

    added = [c for c in again.zero.block_classes if c not in cfg.zero.block_classes]
    latest = latest_on_disk(ckpt_dir)
    where = (
        f"the checkpoint of step {latest.step} ({latest.path})" if latest else "step 0 (no checkpoint yet)"
    )
    return (
        f"zoff: {regather.recorded(out)[1]}\n"
        f"zoff: restarting from {where}, gathering every {', '.join(added)} as one unit; "
        f"to start that way, put in the config: zero.block_classes: [{', '.join(again.zero.block_classes)}]"
    )


def stop_line(sig: int, aborted_by: int | None, cfg: Config, ckpt_dir: Path, before: OnDisk | None) -> str:
    """After a stop by signal `sig` (the ranks killed by a second one, `aborted_by`, if not None): the checkpoint
    saved for it, or that there is none and what --resume auto loads instead.
    Read from the checkpoint directory now, not assumed from the signal: the ranks may have been killed, or
    have timed out in a collective, before they could save."""
    from zoff.checkpoint.status import latest_on_disk

    head = f"zoff: stopped by {_signal_name(sig)}"
    if aborted_by is not None:
        again = "a second one" if aborted_by == sig else _signal_name(aborted_by)
        head += f", the ranks killed by {again}"
    now = latest_on_disk(ckpt_dir)
    if now is not None and now.for_stop and now.saved_since(before):
        if now.problem is None:
            return f"{head} after checkpointing step {now.step} ({now.path}); continue with:"
        return (
            f"{head}; the checkpoint written for it, {now.path}, is damaged: {now.problem}; it will not load:"
        )
    head += "; no checkpoint was written for the stop"
    if not cfg.checkpoint.enabled:
        head += " (checkpoint.enabled is false)"
    return f"{head}; {_latest_clause(now, before, ckpt_dir)}"


def failure_line(ckpt_dir: Path, before: OnDisk | None) -> str:
    """After a failed run: the checkpoint --resume auto would continue from, read from the directory now."""
    from zoff.checkpoint.status import latest_on_disk

    return f"zoff: {_latest_clause(latest_on_disk(ckpt_dir), before, ckpt_dir)}"


def disk_error_line(error: str, ckpt_dir: Path, before: OnDisk | None) -> str:
    """After a disk's I/O error ended the run (`error`: disk_error.take's), one line: the error, then the
    checkpoint --resume auto would continue from, read from the directory now."""
    from zoff.checkpoint.status import latest_on_disk

    return f"zoff: disk error: {error}; {_latest_clause(latest_on_disk(ckpt_dir), before, ckpt_dir)}"


def _latest_clause(now: OnDisk | None, before: OnDisk | None, ckpt_dir: Path) -> str:
    """'the last complete checkpoint is step 40 (PATH, saved by this run); continue from it with:' or
    what stands in its place: none at all, or a damaged one that --resume auto will refuse."""
    if now is None:
        return f"{ckpt_dir} holds no complete checkpoint; start again with:"
    when = "saved by this run" if now.saved_since(before) else "saved before this run"
    if now.problem is not None:
        return f"the latest checkpoint, {now.path} ({when}), is damaged: {now.problem}; it will not load:"
    return f"the last complete checkpoint is step {now.step} ({now.path}, {when}); continue from it with:"


def _signal_name(sig: int) -> str:
    import signal

    try:
        return f"signal {sig} ({signal.Signals(sig).name})"
    except ValueError:
        return f"signal {sig}"


def resume_command(run_dir: Path) -> str:
    """This very command line with --run-dir fixed and --resume auto: what continues the run."""
    import shlex

    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("--resume", "--run-dir"):
            skip = True
            continue
        if a.startswith(("--resume=", "--run-dir=")):
            continue
        args.append(a)
    return shlex.join(["zoff", *args, "--run-dir", str(run_dir), "--resume", "auto"])
