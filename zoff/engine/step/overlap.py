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


class UnitReadiness:
    """Per trainable unit: whether this step's update of it is done (set from the walk thread)."""

    def __init__(self, units: int):
        self.ready = [threading.Event() for _ in range(units)]
        self.end()

    def begin(self) -> None:
        for e in self.ready:
            e.clear()

    def unit_done(self, u: int) -> None:
        self.ready[u].set()

    def end(self) -> None:
        """The walk ended (or failed): nothing is waited for any longer; a failure surfaces at its join."""
        for e in self.ready:
            e.set()

    def wait(self, u: int) -> None:
        if u < len(self.ready):  # stage 3's frozen units have no update
            self.ready[u].wait()
