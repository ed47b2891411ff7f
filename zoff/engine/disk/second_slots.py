"""The disk tier's second slots for exact speculation (step/speculate.py): which units get them and what they
cost. Pure functions of the plan, the placement and the disk's free room, so that the engine allocates,
`zoff estimate` predicts and the start-up plan says the same bytes.

A speculated unit's update is computed during backward from the slot its states are in and written to the
other one; commit flips the slot. So each of its streamed pieces needs a second copy of its three states on
disk (12 B/param/N, whole pages: the piece's bytes in the optimizer's swap file), and, with parameters on
disk, its parameter shard a second region (the new shard is written there; the old one stays what backward's
gathers read). Units the host budget keeps in RAM are not speculated (they would need a second RAM copy: the
walk steps them without any disk I/O anyway). Units are taken last first, the order backward finishes their
gradients, as long as their second slots fit the disk's room: what does not fit goes to the walk as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from zoff.config import ZeroConfig
from zoff.engine.disk.placement import DiskSplit, piece_bytes, subgroup_of, unit_pieces
from zoff.engine.disk.swapfile import aligned
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy
from zoff.engine.precision import DTYPES
from zoff.units import human

# Disk room left free beside the second slots: the filesystem's own reserve and whatever else writes there.
ROOM_MARGIN = 1 << 30


@dataclass(frozen=True)
class SecondSlots:
    """The speculated units and their second slots' disk bytes (a pure value: engine and estimate alike)."""

    units: frozenset[int] = frozenset()  # trainable units speculated (all their pieces streamed)
    pieces: frozenset[int] = frozenset()  # their pieces (placement.walk_pieces' indices)
    state_bytes: int = 0  # the optimizer's second slots (optimizer.spec.swap)
    param_bytes: int = 0  # the parameter shards' second regions (params.swap grows by them)
    candidates: int = 0  # units that could be speculated (every piece streamed)
    room: int | None = None  # the disk room they were fitted into (None: not limited)

    @property
    def disk_bytes(self) -> int:
        return self.state_bytes + self.param_bytes

    def describe(self) -> str:
        """One line for the start-up plan and `zoff estimate`."""
        if not self.candidates:
            return "speculation: no unit streams its states (every one is in RAM: the walk needs no disk)"
        short = len(self.units) < self.candidates
        room = (
            f" (the disk's room, {human(self.room)}, holds only these)"
            if short and self.room is not None
            else ""
        )
        return (
            f"speculation: second slots for {len(self.units)} of {self.candidates} streamed units, "
            f"{human(self.disk_bytes)} of disk ({human(self.state_bytes)} of states, {human(self.param_bytes)} of "
            f"parameter shards){room}"
        )


def second_slots(
    plan: PartitionPlan, policy: Policy, zero: ZeroConfig, precision: str, split: DiskSplit, room: int | None
) -> SecondSlots:
    """The units speculated on the disk tier (last first) while their second slots fit `room` bytes (None:
    unlimited)."""
    if policy.offload_optimizer != "nvme":
        return SecondSlots()
    sizes = piece_bytes(plan, subgroup_of(zero))
    pieces = unit_pieces(plan, subgroup_of(zero))
    resident = set(split.resident)
    c = DTYPES[precision].itemsize
    units, chosen, states, params, candidates = set(), set(), 0, 0, 0
    for unit, ks in reversed(list(zip(plan.units, pieces))):
        if not ks or not resident.isdisjoint(ks):
            continue
        candidates += 1
        s = sum(sizes[ks.start : ks.stop])  # (a unit's pieces are consecutive)
        p = aligned(c * unit.shard) if policy.params_on_disk and not unit.persistent else 0
        if room is not None and states + params + s + p > room:
            continue
        units.add(unit.index)
        chosen.update(ks)
        states, params = states + s, params + p
    return SecondSlots(frozenset(units), frozenset(chosen), states, params, candidates, room)


def room_left(free: int | None, base: int) -> int | None:
    """The second slots' room in `free` bytes at nvme_path (None: not known, so not limited) beside `base`,
    the swap files to be made there, less ROOM_MARGIN."""
    return None if free is None else max(0, free - base - ROOM_MARGIN)


def speculation_ram_bytes(
    plan: PartitionPlan, policy: Policy, precision: str, slots: SecondSlots, grads_on_disk: bool,
    accumulating: bool,
) -> int:  # fmt: skip
    """The disk tier's RAM for speculating `slots` beside what its split holds: each speculated unit whose
    parameters are not in the parameter swap file (stages 1-2, parameters offloaded to CPU or kept on the
    device, stage 3's persistent units) keeps its new shard in the compute dtype until commit
    (Publication.speculated_piece); with the gradient shard in its swap file, the worker reads each final
    gradient back into one buffer of the largest unit's (speculation_of). 0 where nothing is speculated."""
    if not slots.units:
        return 0
    c = DTYPES[precision].itemsize
    file = policy.params_on_disk  # (every non-persistent unit's shard is in the parameter swap file)
    copies = sum(
        c * u.shard for u in plan.units if u.index in slots.units and not (file and not u.persistent)
    )
    if not grads_on_disk:
        return copies
    # (in the gradient file's dtype: grad_disk_bytes)
    itemsize = 4 if policy.shard_accum_fp32(accumulating) else c
    return copies + aligned(max(1, max(u.shard for u in plan.units) * itemsize))  # (AlignedBuffer's bytes)


def host_second_units(plan: PartitionPlan, room: int | None) -> frozenset[int]:
    """The host tier's speculated units: the last first (backward finishes them first) while their second
    buffers (12 B per element of the shard: fp32 master and moments once more) fit `room`, the host budget
    left beside everything else the rank holds (None: the budget is min, nothing is left)."""
    units, used = set(), 0
    for u in reversed(plan.units):
        if room is None or used + 12 * u.shard > room:
            continue
        units.add(u.index)
        used += 12 * u.shard
    return frozenset(units)


def second_buffer_bytes(plan: PartitionPlan, units: frozenset[int] | None = None) -> int:
    """The host tier's second buffers (step/states.ResidentStates) of `units` (None: every trainable unit),
    12 B per element of the rank's shard, allocated at their first speculated step."""
    return 12 * sum(u.shard for u in plan.units if units is None or u.index in units)
