"""The engine's side of exact speculation (step/speculate.py): whether an engine speculates, which units, and
the three moments of a step it acts in: the last backward begins it, the step commits what is exact (or the
step's failure discards it), before the walk takes the rest.

`auto` (zero.offload_optimizer.speculate, the offload recipes' default): the disk tier speculates, and the host
tier when backward runs on a GPU (on a host-only machine the worker's CPU Adam would run on backward's own two
cores, for nothing). A step speculates when the last step's clipping factor was exactly 1 and nothing
overflowed (the first step does not): a run that clips every step speculates never, and one that stops
clipping pays one step's speculation each time it clips again. `true` speculates every step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from zoff.config import OffloadOptimizerConfig
from zoff.engine.disk.budget import host_budget_bytes, mem_total
from zoff.engine.disk.grad_swap import DiskGrads
from zoff.engine.disk.placement import disk_bytes, grad_disk_bytes
from zoff.engine.disk.second_slots import SecondSlots, host_second_units, room_left, second_slots
from zoff.engine.disk.swapfile import AlignedBuffer
from zoff.engine.step.optimizer import step_runs
from zoff.engine.step.speculate import Speculation, commit_set


def speculates(oo: OffloadOptimizerConfig, device: torch.device, tier: str) -> bool:
    """Whether an engine with this offload config speculates at all (the rule in the module's docstring); `tier`:
    the optimizer tier's kind (disk, host) or its device (nvme, cpu)."""
    if oo.device == "none" or oo.delay_update or oo.speculate is False:
        return False
    return oo.speculate is True or tier in ("nvme", "disk") or device.type == "cuda"


def disk_room(oo: OffloadOptimizerConfig, base_bytes: int, local_ranks: int) -> int | None:
    """This rank's room for second slots at nvme_path: its share of the free space (the node's ranks share the
    disk, as the estimate divides it) less the swap files to be made there and a margin (None: the folder does
    not exist yet, so nothing is limited here; the swap files will say)."""
    try:
        free = shutil.disk_usage(Path(oo.nvme_path)).free
    except OSError:
        return None
    return room_left(free // max(1, local_ranks), base_bytes)


def second_slots_of(engine) -> SecondSlots:
    """The disk tier's speculated units, fitted into the disk's room (before any swap file exists)."""
    oo = engine.zero.offload_optimizer
    if oo.device != "nvme" or not speculates(oo, engine.device, "nvme"):
        return SecondSlots()
    grads = grad_disk_bytes(engine.plan, engine.policy, engine.split, engine.grad_accum > 1, engine.precision)
    base = disk_bytes(engine.plan, engine.policy, engine.precision, grads)
    room = disk_room(oo, base, local_ranks(engine.comm.world))
    return second_slots(engine.plan, engine.policy, engine.zero, engine.precision, engine.split, room)


def speculation_of(engine) -> Speculation | None:
    """The engine's Speculation, or None where it never speculates."""
    oo = engine.zero.offload_optimizer
    tier = engine.optimizer.tier.kind
    if tier not in ("host", "disk") or not speculates(oo, engine.device, tier):
        return None
    units = engine.second.units if tier == "disk" else host_second_units(engine.plan, host_room(engine))
    if not units:
        return None
    grads, buffer = engine.grads, None
    if isinstance(grads, DiskGrads):  # a final gradient read back from its file, one unit at a time
        buffer = AlignedBuffer(max(u.shard for u in engine.plan.units) * grads.dtype.itemsize)
    return Speculation(
        engine.optimizer, grads, engine.publication.speculated_piece, units, oo.speculate, buffer
    )


def host_room(engine) -> int | None:
    """The host tier's room for second buffers: the host budget (zero.offload_optimizer.host_budget, per rank)
    less what the rank holds in host memory: its other host bytes (host_reserved) and the tier's states,
    gradient shards and buffers (None: the budget is min)."""
    oo = engine.zero.offload_optimizer
    budget = host_budget_bytes(oo, mem_total(), local_ranks(engine.comm.world))
    if budget is None:
        return None
    opt = engine.optimizer
    return (
        budget
        - engine.host_reserved
        - opt.resident_bytes()
        - engine.grads.host_bytes()
        - opt.tier.buffer_bytes()
    )


def local_ranks(world: int) -> int:
    """The ranks sharing this host (torch elastic's LOCAL_WORLD_SIZE; else, a single-node world)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


class EngineSpeculation:
    """ZeroEngine's speculation moments (a part of the engine class, as report.py and engine_state.py are)."""

    def _begin_speculation(self, lr: float | None) -> bool:
        """At the last micro-batch's backward: start the worker if this step speculates (the lr is known)."""
        spec = self.speculation
        if spec is not None:
            if spec.active or spec.stopped:  # a sync backward whose step never came (nothing of it commits)
                self._discard_speculation()
            spec.last = {}  # (this step's counts, if it speculates)
        if spec is None or lr is None or spec.failure or not spec.wanted() or not self._second_places():
            return False
        # the runs the step takes where every parameter gets a gradient (optimizer.unit_runs: per unit)
        runs = step_runs(self.plan, self.rank, set(), self.skipped_steps, self.optimizer.step_count + 1)
        spec.begin(lr, 1.0 / self.scaler.scale, runs)
        return True

    def _second_places(self) -> bool:
        """The second slots' disk space, claimed at the first speculated step (a run that never speculates
        never takes it); a disk without the room turns speculation off for the run on every rank (the next
        step's all-reduce carries it: speculation_failed)."""
        try:
            self.optimizer.states.allocate_second()
            if self.param_disk is not None:
                self.param_disk.allocate_second()
        except OSError as e:
            self.speculation.failure = str(e)
            return False
        return True

    def _speculation_flags(self, lr: float, base: float) -> list[float]:
        """Before the norm's all-reduce, which carries them: per trainable unit, 1 where this rank's worker
        completed it untainted with this step's lr and coefficient `base` (the worker stopped, the unit in
        hand finished), then per rank, 1 at this rank if its speculation failed. A unit commits only where
        every rank's flag is 1 (commit_set): the all-gathers after the step follow the committed set, so every
        rank must have the same one. [] where the config never speculates (every rank alike)."""
        if not self.speculates:
            return []
        spec, n = self.speculation, len(self.plan.units)
        flags = [0.0] * (n + self.comm.world)
        if spec is not None:
            if spec.active:
                spec.stop(commit=True)
            if spec.stopped:
                flags[:n] = spec.unit_flags(lr, base)
            flags[n + self.comm.rank] = 1.0 if spec.failure else 0.0
        return flags

    def _commit_speculation(self, exact: bool, unused: list[int], sums: list[float]) -> frozenset[int]:
        """After the norm: the units every rank completed whose speculative update is the step's (`exact`:
        may_commit; no parameter of theirs in `unused`, the slots no rank gave a gradient) become the step's,
        published; the rest is discarded. Returns the committed units. `sums`: the all-reduced flags."""
        n = len(self.plan.units)
        failed = [r for r, x in enumerate(sums[n:]) if x]
        if failed:
            self._speculation_failed(failed)
            return frozenset()
        spec = self.speculation
        if spec is None:
            return frozenset()
        spec.last_unclipped = exact
        if not spec.stopped:
            return frozenset()
        blocked = {self.plan.slots[s].unit for s in unused}
        units = commit_set(sums[:n], self.comm.world, exact, blocked)
        self._end_speculation(units)
        spec.record(len(units))
        return units

    def _speculation_failed(self, ranks: list[int]) -> None:
        """A speculation failed on `ranks` (every rank knows it from the same all-reduce): every rank discards
        this step's speculation and turns it off for the run, saying so once; the step walks as without it."""
        spec = self.speculation
        why = spec.failure if spec is not None and spec.failure else None
        self._discard_speculation()
        self.speculation, self.speculates = None, False
        where = "this rank" if why else f"rank(s) {', '.join(map(str, ranks))}"
        print(
            f"zoff: warning: speculation (zero.offload_optimizer.speculate) off for the rest of this run: it "
            f"failed on {where}{': ' + why if why else ''}; this step and the next walk without it (the same "
            f"bits, without the overlap)",
            flush=True,
        )

    def stop_speculation(self) -> None:
        """Stop a worker still running from a backward whose step has not come, discarding what it computed
        (the step then walks every unit: the same bits). Whatever reads or writes the states or parameters
        between backward and step calls this first: the worker owns the disk tier's buffers until it stops."""
        spec = self.speculation
        if spec is not None and (spec.active or spec.stopped):
            self._discard_speculation()

    def _discard_speculation(self, overflowed: bool = False) -> None:
        """A step that will not use the speculation (`overflowed`: fp16's, which auto counts as a clipped step;
        a failed landing, a backward that raised, a window that never stepped, a reader before the step). A
        worker's error stays in `failure` for the next step's all-reduce."""
        spec = self.speculation
        if spec is None:
            return
        if overflowed:
            spec.last_unclipped = False
        if not spec.active and not spec.stopped:
            return
        if spec.active:
            spec.stop(commit=False)
        self._end_speculation(frozenset())
        spec.record(0)

    def _end_speculation(self, units: frozenset[int]) -> None:
        """Commit `units` (their states, then their parameters), forget the rest."""
        if self.speculation is not None:
            self.speculation.stopped = False
        states = self.optimizer.states
        for u in units:
            for k, _, _ in states.spans(u):
                states.commit(k)
        states.end_speculation()
        handles = []
        self.publication.commit(units, handles)
        for h in handles:
            h.wait()
