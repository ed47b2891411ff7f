"""Graceful preemption in a rank: the first SIGTERM/SIGINT asks it to finish the step, checkpoint and exit.

Later signals are ignored here. Stopping at once is the launcher's job: its second SIGTERM/SIGINT kills the
ranks with SIGKILL (zoff/launch/elastic.py), which also reaches a rank that is stopped or blocked in a collective,
where no Python handler runs. A rank cannot tell a second request from a copy of the first anyway: one
Ctrl-C reaches it from the terminal (the whole foreground process group gets SIGINT) and again from the
agent, which forwards what the launcher got; Slurm's scancel signals every process of the step, the launcher
included. Aborting on such a copy would throw away the checkpoint the user asked for.
"""

from __future__ import annotations

import signal


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


# One per process: the worker installs it before its heavy imports, so an early signal is not lost.
STOP = StopRequest()
