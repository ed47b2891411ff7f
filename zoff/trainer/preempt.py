"""Graceful preemption: the first SIGTERM/SIGINT asks the ranks to finish the step, checkpoint and exit.

A second signal of the same kind aborts at once. A signal of the other kind is ignored, because one Ctrl-C
reaches the workers twice: SIGINT from the terminal, then SIGTERM forwarded by the elastic agent.
"""

from __future__ import annotations

import signal
import sys


class StopRequest:
    """Set by a signal handler; the trainer polls it once per step (all ranks agree through a collective)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> StopRequest:
        """Idempotent: a signal already received stays recorded."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signal = signum
            return
        if signum == self.signal:  # asked twice: stop now, without a checkpoint
            signal.signal(signum, signal.SIG_DFL)
            sys.stderr.write(f"zoff: second {signal.Signals(signum).name}: aborting without a checkpoint\n")
            sys.exit(128 + signum)


# One per process: the worker installs it before its heavy imports, so an early signal is not lost.
STOP = StopRequest()
