"""A disk that fails mid-run: an I/O error (EIO, ENOSPC, ...) in a swap file's read or write or in a checkpoint
being written (errors.DiskError) ends the run, and `zoff train` says so in one line naming the file, the error,
what was being done and at which step, then the checkpoint really on disk (run_end.disk_error_line), exit 1.

The rank that met the error records it in the run directory for the launcher, as a non-finite stop is
(nonfinite.py), and fails; the other ranks fail in their next collective, or are stopped by torch's agent. The
launcher reads the record once the ranks are gone. The first rank to record wins (O_EXCL): another rank's
failure that follows, a peer's collective error, is a consequence. Where the record cannot be written (the run
directory on the failed disk), `zoff train` ends with its generic failure lines instead.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from zoff.errors import DiskError

RECORD = "disk_error.json"


@contextlib.contextmanager
def recorded_on_failure(run_dir: Path, rank: int, step_of) -> Iterator[None]:
    """Around a rank's run: a DiskError raised inside is recorded (`step_of(error)`: the step it names), then
    raised on. Where a later one replaced it (an engine's close meeting the same dead disk), the first."""
    try:
        yield
    except DiskError as e:
        first = e
        while isinstance(first.__context__, DiskError):
            first = first.__context__
        _note(run_dir, rank, first, step_of(first))
        raise


def _note(run_dir: Path, rank: int, e: DiskError, step: int) -> None:
    data = {"rank": rank, "step": step, "errno": e.errno, "error": str(e), "what": e.what}
    with contextlib.suppress(OSError):  # another rank's record is there, or the run directory's disk failed
        fd = os.open(run_dir / RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data) + "\n")


def clear(run_dir: Path) -> None:
    """Before the ranks start: a record of an earlier launch is not this one's."""
    (run_dir / RECORD).unlink(missing_ok=True)


def take(run_dir: Path) -> str | None:
    """The recorded error as the line's first part ("[Errno 5] Input/output error: PATH (swap write at byte
    0, step 7, rank 1)"), and the record removed; None when there is none (or it is not one of ours)."""
    path = run_dir / RECORD
    try:
        with path.open("rb") as f:
            data = json.loads(f.read(1 << 16))  # (a few hundred bytes; never more read)
    except (OSError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("error", "what")):
        return None
    return f"{data['error']} ({data['what']}, step {data.get('step')}, rank {data.get('rank')})"
