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
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from zoff.engine.comm.collectives import Comm
    from zoff.engine.partition import PartitionPlan
    from zoff.engine.policy import Policy
    from zoff.engine.precision import RescaledGrads
    from zoff.engine.step.optimizer import ShardOptimizer
    from zoff.engine.step.publish import Publication

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


class OverlappedStep:
    """The engine's overlapped step: the update walks in the background (ShardOptimizer's thread), the next
    forward's gathers wait per unit (wait_unit, the gatherer's wait_ready), and only the persistent units'
    all-gathers (collectives) stay on the main thread."""

    def __init__(
        self, plan: PartitionPlan, policy: Policy, comm: Comm, optimizer: ShardOptimizer,
        publication: Publication, shard_params: list[torch.Tensor], full: list[torch.Tensor],
    ):  # fmt: skip
        self.plan, self.policy, self.comm = plan, policy, comm
        self.optimizer, self.publication = optimizer, publication
        self.shard_params, self.full = shard_params, full
        self.staging = optimizer.tier.staging  # offload on a GPU: the uploads' side stream
        self.readiness = UnitReadiness(len(plan.units))
        optimizer.on_background_end = self.walk_ended

    def update(
        self, grads: RescaledGrads, lr: float, runs: list | None, t0: float, skip: frozenset[int]
    ) -> dict[str, float]:
        """The walk in the background; here the persistent units' all-gathers, each once its update is in.
        `skip`: units the speculation committed (published already)."""
        self.readiness.begin()
        for u in skip:
            self.readiness.unit_done(u)
        copy = not self.optimizer.writes_live_shards
        per_unit = PER_UNIT_UPLOAD_WAIT and self.staging is not None

        def on_unit(u: int, lo: int | None, master: torch.Tensor | None) -> None:
            if lo is None:  # the forward's gather of u waits for u's uploads, not for the walk's later ones
                self.readiness.unit_done(u, self.staging.mark() if per_unit else None)
            else:  # a shard or the swap file: no collective
                self.publication.piece(u, lo, master, copy, [], ordered=not per_unit)

        self.optimizer.step(grads, lr, on_unit=on_unit, runs=runs, background=True, skip=skip)
        t1 = time.perf_counter()
        handles = []
        for u, unit in enumerate(self.plan.units):
            if self.policy.gathers_after_step(unit.persistent) and u not in skip:
                self.wait_unit(u)
                handles.append(self.comm.all_gather(self.shard_params[u], self.full[u], async_op=True))
        for h in handles:
            h.wait()
        self.publication.stepped(delayed=False)  # the forward reads each unit once its update is in
        return {"optimizer_s": t1 - t0, "publish_s": time.perf_counter() - t1,
                "last_walk_s": self.optimizer.last_background_s}  # fmt: skip

    def wait_unit(self, u: int) -> None:
        """Before unit u's shard is read (a gather, an all-gather): its update in the walk is done, and the
        kernels queued from here wait for its uploads on the GPU."""
        mark = self.readiness.wait(u)
        if self.optimizer.failed:
            self.optimizer.finish()  # raises the walk's error, here rather than on stale parameters
        if mark is not None:
            self.staging.wait_for(mark)

    def walk_ended(self) -> None:
        """(On the walk thread, as it ends, even by an error.) Whatever the main thread queues after the walk (the
        next backward, a checkpoint, an evaluation) waits for every upload on the GPU; nothing waits on the host."""
        if self.staging is not None:
            self.staging.uploads_done()
        self.readiness.end()
