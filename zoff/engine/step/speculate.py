"""Exact speculation (zero.offload_optimizer.speculate): the optimizer's update computed beside backward, made
visible only when it is the step, bit for bit.

Why: under offload the step needs the global gradient norm (clipping) before any update, so the CPU Adam and
the disk tier's walk followed backward (or, with overlap_step, the next forward), while during backward the
disk sat idle. But the norm limits when an update may become visible, not when it may be computed. The step's
coefficient is `1/scale * min(clip / (norm + 1e-6), 1.0)`: where the clip does not trigger, the second factor
is exactly 1.0, and the fused CPU kernel skips the multiply at a gradient scale of 1 (cpu_adam.cpp). So an
update computed during backward with `1/scale` and the coming step's lr is the step itself.

How: during the last micro-batch's backward, the gradient store tells this worker each unit whose gradient is
final (grad_store.GradShards.on_final); the worker updates the unit into its pieces' second places
(States.speculate: a second slot per piece on the disk tier, second buffers on the host tier) and keeps its
new parameters apart (Publication.speculated_piece). After the one all-reduce that gives the norm, the engine
commits a unit only if the clipping factor is exactly 1.0 (compared as the factor, not `norm <= clip`: NaN
fails it by itself), nothing overflowed, every rank's worker completed it with the lr and coefficient the step
uses from a gradient final once (no late correction: a second final landing taints it), none of its
parameters went without a gradient on every rank (its runs would differ: optimizer.unit_runs), and no landing
failed (the step raises before this). Every one of these facts is the same on every rank: the rank-local ones
travel as per-unit flags in the norm's all-reduce (commit_set), so all ranks commit the same units, which
their all-gathers after the step rely on. A worker that fails on any rank turns speculation off on every rank
(the same all-reduce carries it) and the step walks as without it. Everything else is discarded, and the
walk steps it from the stored gradients as before; a unit the worker did not reach goes to the walk too, and
a committed unit stays exact whatever the walk does with the others. Never the live states or parameters
until commit: a discarded speculation leaves every byte of them as it was.

Cost: the worker's CPU Adam runs beside backward (on a GPU host on the host's cores, idle then; on a host-only
machine on backward's own cores, which is why `auto` leaves the host tier alone there); the second places'
disk bytes and RAM (second_slots.py, ResidentStates); a unit's gradient read once more from a gradient file.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from zoff.engine.step.grad_store import GradShards
from zoff.engine.step.optimizer import ShardOptimizer, StepRun


def may_commit(factor: float, overflowed: bool) -> bool:
    """Whether a step may use speculated updates at all: its clipping factor exactly 1 (NaN fails) and no
    overflow. Every rank computes both from the same all-reduce."""
    return factor == 1.0 and not overflowed


def commit_set(flags: list[float], world: int, exact: bool, blocked: set[int]) -> frozenset[int]:
    """The units a step commits: with `exact` (may_commit), those whose flag every rank set (`flags`: the
    all-reduced sums of the ranks' unit_flags) and none of whose parameters went without a gradient on every
    rank (`blocked`). Only facts every rank holds alike."""
    if not exact:
        return frozenset()
    return frozenset(u for u, n in enumerate(flags) if n == world and u not in blocked)


class Speculation:
    """One engine's speculation: its rule (`mode`), the units it may speculate, and one step's worker."""

    def __init__(
        self, optimizer: ShardOptimizer, grads: GradShards, keep_piece: Callable[[int, int, torch.Tensor], None],
        units: frozenset[int], mode, buffer=None,
    ):  # fmt: skip
        self.optimizer, self.grads, self.keep_piece = optimizer, grads, keep_piece
        self.units, self.mode = units, mode  # mode: "auto" or True (False builds no Speculation)
        self.buffer = buffer  # where a gradient on disk is read to (swapfile.AlignedBuffer; None: in memory)
        self.last_unclipped = False  # auto: the last step's factor was 1 and nothing overflowed
        self.active = False  # the worker runs
        self.stopped = False  # the worker has stopped; its results wait to be committed or discarded
        # run totals, for the records (tainted: units a late correction changed after their final landing)
        self.counts = {"steps": 0, "committed_units": 0, "speculated_units": 0, "tainted_units": 0}
        self.last: dict[str, int] = {}  # the last step's: speculated, committed, units (the trainable ones)
        self.failure: str | None = None  # what failed (the worker, its second places), until the step says so
        self.done: set[int] = set()
        self.tainted: set[int] = set()

    def wanted(self) -> bool:
        """Whether the coming step speculates: always (true), or (auto) when the last step did not clip."""
        return bool(self.units) and (self.mode is True or self.last_unclipped)

    def begin(self, lr: float, coef: float, runs: list[list[StepRun]]) -> None:
        """Start the worker for the last micro-batch's backward: updates with `lr`, gradient coefficient `coef`
        (1/scale: the factor 1) and `runs`, the runs the step will take if every parameter gets a gradient."""
        self.lr, self.coef, self.runs = lr, coef, runs
        self.done: set[int] = set()
        self.seen: set[int] = set()
        self.tainted: set[int] = set()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.closing = self.aborting = False
        self.error: BaseException | None = None
        self.failed_unit: int | None = None
        self.grads.on_final = self._landed
        self.thread = threading.Thread(target=self._work, name="zoff-speculate", daemon=True)
        self.active = True
        self.thread.start()

    def _landed(self, u: int, writes: list) -> None:
        """(The landing's thread.) Unit u's gradient is final; a second time means a late correction."""
        if u in self.seen:
            self.tainted.add(u)
        self.seen.add(u)
        self.queue.put((u, writes))

    def _work(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if item is None or self.closing:
                    return
                u, writes = item
                if u in self.tainted or u not in self.units:
                    continue
                self.failed_unit = u
                if self._unit(u, writes):
                    self.done.add(u)
                self.failed_unit = None
        except BaseException as e:  # surfaced by stop() on the engine's thread: no step is applied
            self.error = e

    def _unit(self, u: int, writes: list) -> bool:
        g = self.grads.final_view(u, writes, self.buffer)
        scale = self.coef
        if g.dtype == torch.float32 or not self.optimizer.fuses_grad_scale:
            # what RescaledGrads does to an fp32 shard in place (x * coef), here into a copy: the store's
            # gradient stays as the walk would read it if this unit is discarded
            g, scale = (g.mul(self.coef) if self.coef != 1.0 else g), 1.0
        return self.optimizer.speculate_unit(
            u, g, scale, self.lr, self.runs[u], self.keep_piece, lambda: self.aborting
        )

    def stop(self, commit: bool) -> set[int]:
        """End the worker (`commit`: it finishes the unit in hand; else it stops at the next piece) and return
        the units it completed; a failed worker completed none, and its error waits in `failure` for the
        step's all-reduce (every rank then turns speculation off: a raise here would leave the others waiting
        in that all-reduce)."""
        self.grads.on_final = None
        self.closing, self.aborting = True, not commit
        self.queue.put(None)
        self.thread.join()
        self.active, self.stopped = False, True
        if self.error is not None:
            err, self.error = self.error, None
            where = f" on unit {self.failed_unit}" if self.failed_unit is not None else ""
            self.failure = f"the speculative optimizer step failed{where}: {type(err).__name__}: {err}"
            self.done = set()
        return set(self.done)

    def unit_flags(self, lr: float, coef: float) -> list[float]:
        """This rank's per-unit flags for the step's all-reduce (the worker stopped): 1 where it completed the
        unit untainted with the step's lr and coefficient."""
        same = lr == self.lr and coef == self.coef
        done = self.done - self.tainted if same else set()
        return [1.0 if u in done else 0.0 for u in range(len(self.optimizer.shards))]

    def record(self, committed: int) -> None:
        """The step's counts (run totals and the last step's)."""
        speculated = len(self.done)
        self.last = {"speculated": speculated, "committed": committed, "units": len(self.optimizer.shards)}
        self.counts["steps"] += 1
        self.counts["speculated_units"] += speculated
        self.counts["committed_units"] += committed
        self.counts["tainted_units"] += len(self.tainted)
