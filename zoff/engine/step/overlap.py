"""The overlapped step (zero.offload_optimizer.overlap_step): the optimizer walks its shard in a background
thread while the next forward runs, and the forward waits for each block's update before gathering it.

Why: with the disk tier the step's own I/O (every streamed state read and written, the parameter shards
written back) otherwise follows backward and precedes the next forward, with the cores idle on it. The walk
goes unit by unit in the plan's order, which is the forward's (the persistent units, the root, then the
blocks), so the forward trails the walk by a block and the disk works while the model computes.

Exact: the same update of each element from the same gradient, clipping coefficient and step count, only
run later; nothing the forward reads is read before its unit's update and write-back are done. What runs
where: the walk thread steps pieces and writes parameter shards back (param_swap.SwappedShards serialises
its write queue with the gathers' reads); every collective stays on the main thread (the persistent units'
all-gathers wait here for their updates). Backward, a checkpoint, evaluation of the masters or the next step
first join the walk (ShardOptimizer.finish), so no gradient is overwritten while the walk reads it.
"""

from __future__ import annotations

import threading

# The forward's gather of a unit waits on the GPU for that unit's uploads only (UnitReadiness's marks); False:
# every kernel queued after a unit's publication waits for every upload issued so far (the walk is ahead of
# the forward, so the forward's kernels waited for units it had not reached). Only scripts/gpu_bench.py sets
# it, to measure the difference; a host-only machine uploads nothing either way.
PER_UNIT_UPLOAD_WAIT = True


class UnitReadiness:
    """Per trainable unit: whether this step's update of it is done (set from the walk thread), and where the
    device has uploads in flight, the mark (staging.mark) its reader's stream waits for."""

    def __init__(self, units: int):
        self.ready = [threading.Event() for _ in range(units)]
        self.marks: list[object | None] = [None] * units
        self.end()

    def begin(self) -> None:
        for e in self.ready:
            e.clear()
        self.marks = [None] * len(self.ready)

    def unit_done(self, u: int, mark: object | None = None) -> None:
        self.marks[u] = mark
        self.ready[u].set()

    def end(self) -> None:
        """The walk ended (or failed): nothing is waited for any longer; a failure surfaces at its join."""
        for e in self.ready:
            e.set()

    def wait(self, u: int) -> object | None:
        """Once unit u's update is in: the mark of its uploads (None: nothing in flight, or no update)."""
        if u >= len(self.ready):  # stage 3's frozen units have no update
            return None
        self.ready[u].wait()
        return self.marks[u]
