"""The disk tier's placement: what stays in RAM, where each piece of the optimizer's states lies on disk and in
RAM, and the order the step walks the pieces in. Pure functions of the partition plan, the policy and the
config, so that the engine allocates, `zoff estimate` predicts and the checkpoint lays out the same bytes.

- The walk (walk_pieces): every trainable unit in the plan's order, each in pieces of at most one sub-group
  (zero.offload_optimizer.io.subgroup_mb) from its first element on. A piece's index is its place in the
  walk: the step steps the pieces in that order, the swap file reads ahead in it (state_swap.SwappedStates)
  and the budget spreads the units it keeps in RAM over it (spread_units).
- On disk: the optimizer's swap file is the rank's checkpoint shard (partition_layout: per unit its master,
  exp_avg and exp_avg_sq, each 4096-aligned); the gradient file (grad_disk_bytes) and the parameter files
  (param_disk_bytes, next_params_bytes) one aligned region per unit.
- In RAM: a piece's three states set apart in the cache's sets (kind_offset, piece_ram_bytes); a ring of
  ring_size piece buffers for the streamed pieces; and the pieces the host budget keeps (disk_split: a
  DiskSplit, which the engine builds its tier from and the estimate prints).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zoff.config import ZeroConfig
from zoff.engine.disk.grad_swap import GRAD_BUFFERS
from zoff.engine.disk.swapfile import ALIGN, HUGE_PAGE, aligned
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy
from zoff.engine.precision import DTYPES
from zoff.engine.step.states import KINDS
from zoff.errors import UserError
from zoff.files.tensorfile import FileLayout, file_layout
from zoff.units import human

# ------------------------------------------------------------------------------------------- the walk
RING = 5  # buffers: the piece stepped, two read ahead, two being written back

# A piece's three states in RAM are set apart by a quarter of a 128 KiB cache way more than their length, and
# start a quarter way in: the I/O buffers are transparent huge pages (swapfile.AlignedBuffer), so an address's
# cache set is its offset, and master, moments and the gradient (whose buffer starts on a huge page) at equal
# offsets would share every set of the cache the CPU Adam streams them through. Measured on this project's
# machines (scripts/bench_io_contention.py, one 64M-parameter piece stepped over and over, which the cache
# favours): 48 ms a step aligned or on plain pages, 19-30 ms apart; in the 3.4B demo's walk, whose pieces come
# fresh from disk, its CPU Adam went from 4.5 to 4.3 s. Cost: up to 128 KiB of RAM per piece (piece_ram_bytes), only for states of a huge page or more
# (smaller pieces keep the plain layout: the skew would be a large share of them); the file is unchanged.
SKEW, WAY = 32 << 10, 128 << 10


def _skewed(part: int) -> bool:
    return part >= HUGE_PAGE


def kind_offset(part: int, kind: int) -> int:
    """Byte offset of state `kind` (KINDS' index) of a piece of `part` bytes per state, in its RAM region."""
    return (kind + 1) * SKEW + kind * part if _skewed(part) else kind * part


def piece_ram_bytes(part: int) -> int:
    """RAM of a piece's three states of `part` bytes each (kind_offset's layout): skewed ones in whole cache
    ways, so that the next piece starts a way too."""
    end = kind_offset(part, 2) + part
    return -(-end // WAY) * WAY if _skewed(part) else end


def ring_size(units: int) -> int:
    """Piece buffers of the disk tier (fewer when there are fewer pieces: a single piece needs one). Five, not
    three: with three, the buffer of the piece before last is still being written when the next read would
    start, so the disk read only one piece ahead and the step waited on each read (454M params, 4 layers of
    the 3.4B demo, everything on disk: optimizer phase 4.5-4.7 s with five against 4.9-5.0 s with three, one
    run each; cost: two more sub-groups of RAM, 192 MiB at the default io.subgroup_mb)."""
    return max(1, min(RING, units))


def subgroup_numel(subgroup_mb: int) -> int:
    """Parameters per disk-tier sub-group: its master and two moments (12 B each) fill subgroup_mb, in whole
    pages (4096 elements, so every region stays aligned)."""
    return max(4096, (subgroup_mb << 20) // 12 // 4096 * 4096)


def piece_spans(numel: int, piece: int | None) -> list[tuple[int, int]]:
    """A unit's [lo, hi) pieces of at most `piece` elements (None: the whole unit); at least one piece."""
    step = _piece_step(numel, piece)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)] or [(0, 0)]


def piece_count(numel: int, piece: int | None) -> int:
    """len(piece_spans(numel, piece)), without building them."""
    return max(1, -(-numel // _piece_step(numel, piece)))


def _piece_step(numel: int, piece: int | None) -> int:
    return max(1, piece or numel or 1)


def walk_pieces(
    shard_numels: tuple[int, ...] | list[int], subgroup: int | None
) -> list[tuple[int, int, int]]:
    """The walk's order: piece k is the k-th (unit, lo, hi) of this list, every unit's [lo, hi) pieces of at
    most `subgroup` elements (None: the whole unit) in unit order."""
    return [(i, lo, hi) for i, n in enumerate(shard_numels) for lo, hi in piece_spans(n, subgroup)]


# ------------------------------------------------------------------------------------- where on disk
def partition_entries(shard_numels: list[int]) -> list[tuple[str, list[int], torch.dtype]]:
    """One rank's optimizer states as tensors of a file: per unit, its three fp32 states, in unit order."""
    return [(f"u{u}.{kind}", [n], torch.float32) for u, n in enumerate(shard_numels) for kind in KINDS]


def partition_layout(shard_numels: list[int]) -> FileLayout:
    """Where partition_entries lie in the swap file and the checkpoint shard: each 4096-aligned."""
    return file_layout(partition_entries(shard_numels), align=ALIGN)


def grad_buffer_bytes(plan: PartitionPlan, itemsize: int) -> int:
    """RAM of the gradient swap file's buffers (grad_swap.DiskGrads): GRAD_BUFFERS of the largest unit shard."""
    return GRAD_BUFFERS * aligned(max((itemsize * u.shard for u in plan.units), default=1))


def grad_disk_bytes(
    plan: PartitionPlan, policy: Policy, split: DiskSplit, accumulating: bool, precision: str,
    delayed: bool = False,
) -> int:  # fmt: skip
    """The gradient swap file per rank (grad_swap.DiskGrads): an aligned region per unit, in fp32 when
    micro-batches accumulate; two such files when `delayed` (DPU: grad_swap.DelayedDiskGrads); 0 unless the
    disk tier keeps its gradients on disk (`split`)."""
    if policy.offload_optimizer != "nvme" or not split.grads_on_disk:
        return 0
    size = 4 if policy.shard_accum_fp32(accumulating) else DTYPES[precision].itemsize
    return aligned(max(ALIGN, sum(aligned(size * u.shard) for u in plan.units))) * (2 if delayed else 1)


def param_swap_path(zero: ZeroConfig) -> str | None:
    """Where parameter offload to nvme puts its swap files: its own nvme_path, else the optimizer's."""
    return zero.offload_param.nvme_path or zero.offload_optimizer.nvme_path


def subgroup_of(zero: ZeroConfig) -> int:
    """The disk tier's sub-group size in parameters, from zero.offload_optimizer.io.subgroup_mb."""
    return subgroup_numel(zero.offload_optimizer.io.subgroup_mb)


@functools.lru_cache(maxsize=64)
def _piece_bytes(shards: tuple[int, ...], subgroup: int | None) -> tuple[int, ...]:
    """piece_bytes by the units' shard sizes. Cached: `zoff estimate --max-model` asks it for every policy of
    every rung and fallback, and a 405B model has ~50,000 pieces (the walk took seconds per rung without)."""
    return tuple(3 * aligned(4 * (hi - lo)) for _, lo, hi in walk_pieces(shards, subgroup))


@functools.lru_cache(maxsize=64)
def _piece_ram(shards: tuple[int, ...], subgroup: int | None) -> tuple[int, ...]:
    return tuple(piece_ram_bytes(n // 3) for n in _piece_bytes(shards, subgroup))  # (three states of n // 3)


def swap_buffer_bytes(
    plan: PartitionPlan, subgroup: int | None = None, split: DiskSplit | None = None
) -> int:
    """The disk tier's states in RAM (state_swap.SwappedStates): `split`'s resident pieces (held whole), and,
    unless every piece is resident, up to ring_size (five) page-aligned ring buffers of the largest other
    piece's master, exp_avg and exp_avg_sq (stepped, read ahead, written back)."""
    shards = _shards(plan)
    sizes = _piece_ram(shards, subgroup)
    resident = set(split.resident) if split is not None else set()
    streamed = len(sizes) - len(resident)
    if resident:
        largest = max((n for k, n in enumerate(sizes) if k not in resident), default=0)
    else:
        largest = _largest_piece_ram(shards, subgroup)
    ring = ring_size(streamed) * largest if streamed else 0
    return sum(sizes[k] for k in resident) + ring


@functools.lru_cache(maxsize=64)
def _largest_piece_ram(shards: tuple[int, ...], subgroup: int | None) -> int:
    return max(_piece_ram(shards, subgroup), default=0)


def _shards(plan: PartitionPlan) -> tuple[int, ...]:
    """The trainable units' shard sizes: what the cached piece arithmetic is keyed by."""
    return tuple(u.shard for u in plan.units)


def piece_bytes(plan: PartitionPlan, subgroup: int | None) -> tuple[int, ...]:
    """Disk bytes each way per step of each piece's three states, whole pages each."""
    return _piece_bytes(_shards(plan), subgroup)


def piece_ram(plan: PartitionPlan, subgroup: int | None) -> tuple[int, ...]:
    """RAM of each piece's three states (piece_ram_bytes: set apart in the cache's sets)."""
    return _piece_ram(_shards(plan), subgroup)


def disk_bytes(
    plan: PartitionPlan, policy: Policy, precision: str = "fp32", grads: int = 0, delayed: bool = False
) -> int:
    """The disk tier's swap files per rank: every unit's fp32 master and moments as a checkpoint shard, under
    parameter offload to nvme every non-persistent parameter shard in the compute dtype, and `grads`, the
    gradient swap file (grad_disk_bytes)."""
    params = param_disk_bytes(plan, policy, precision, delayed) + next_params_bytes(
        plan, policy, precision, delayed
    )
    return optimizer_disk_bytes(plan, policy) + params + grads


def optimizer_disk_bytes(plan: PartitionPlan, policy: Policy) -> int:
    """The optimizer's swap file per rank: its checkpoint shard's layout (partition_layout)."""
    if policy.offload_optimizer != "nvme":
        return 0
    return _layout_bytes(_shards(plan))


@functools.lru_cache(maxsize=64)
def _layout_bytes(shards: tuple[int, ...]) -> int:
    """partition_layout(shards).nbytes, cached like _piece_bytes (the layout is a list of every unit's entries)."""
    return partition_layout(list(shards)).nbytes


def param_disk_bytes(plan: PartitionPlan, policy: Policy, precision: str, delayed: bool = False) -> int:
    """Stage 3's parameter swap file per rank (param_swap.SwappedShards): one aligned region per sharded unit,
    frozen ones included, and a second one per trainable unit when `delayed` (DPU writes the new shards
    there while the next forward reads the old)."""
    if not policy.params_on_disk:
        return 0
    c = DTYPES[precision].itemsize
    twice = len(plan.units) if delayed else 0  # (plan.all_units: the trainable units first)
    return sum(
        aligned(c * u.shard) * (2 if u.index < twice else 1) for u in plan.all_units if not u.persistent
    )


def next_params_bytes(plan: PartitionPlan, policy: Policy, precision: str, delayed: bool) -> int:
    """DPU on the disk tier with the parameters in memory: the file the delayed step writes the new shards
    to and the publication reads them back from (ZeroEngine.next_params), one aligned region per unit."""
    if not (delayed and policy.offload_optimizer == "nvme" and not policy.params_on_disk):
        return 0
    c = DTYPES[precision].itemsize
    return sum(aligned(c * u.shard) for u in plan.units)


def unit_pieces(plan: PartitionPlan, subgroup: int | None) -> list[range]:
    """The disk tier's pieces (piece_bytes' indices) of each trainable unit, in the walk's order."""
    return list(_unit_pieces(_shards(plan), subgroup))


@functools.lru_cache(maxsize=64)
def _unit_pieces(shards: tuple[int, ...], subgroup: int | None) -> tuple[range, ...]:
    """unit_pieces by the units' shard sizes, counted (piece_count) without building the spans; cached like
    _piece_bytes (the estimate asks it for every row: a 405B model's ~1,000 units rebuilt ~60,000 span lists)."""
    out, first = [], 0
    for n in shards:
        count = piece_count(n, subgroup)
        out.append(range(first, first + count))
        first += count
    return tuple(out)


# ------------------------------------------------------------------------------------ what stays in RAM
@dataclass(frozen=True)
class DiskSplit:
    """What the disk tier keeps in RAM under its host budget (disk_split): a pure value, the engine's and the
    estimate's alike."""

    resident: tuple[int, ...] = ()  # pieces of the step's walk held in RAM (whole units, spread_units)
    pieces: int = 0  # all of the optimizer's pieces
    grads_on_disk: bool = False  # the gradient shard in its own swap file (else in host memory)
    budget: int | None = None  # bytes per rank; None: min (only the working set)
    resident_bytes: int = 0  # the resident pieces' states
    states_bytes: int = 0  # every piece's states (the optimizer's swap file, less its header)
    reserved: int = 0  # of the budget, the rank's host memory besides the disk tier's (see disk_split)

    @property
    def resident_pieces(self) -> int:
        return len(self.resident)

    @property
    def all_resident(self) -> bool:
        return self.resident_pieces == self.pieces

    def describe(self) -> str:
        """One line for the start-up plan and `zoff estimate`: where the budget put the states and gradients."""
        budget = "min (only the working set)" if self.budget is None else f"{human(self.budget)} per rank"
        if self.budget is not None and self.reserved:
            budget += f" ({human(self.reserved)} of the rank's other host memory counted against it)"
        grads = "on disk" if self.grads_on_disk else "in RAM"
        return (
            f"host budget {budget}: {human(self.resident_bytes)} of {human(self.states_bytes)} of optimizer "
            f"states in RAM ({self.resident_pieces} of {self.pieces} sub-groups, never read or written by a "
            f"step), the rest streamed from disk; gradient shard {grads}"
        )


def disk_split(
    plan: PartitionPlan, policy: Policy, zero: ZeroConfig, precision: str, accumulating: bool,
    budget: int | None, reserved: int = 0, clipping: bool = True,
) -> DiskSplit:  # fmt: skip
    """How the disk tier spends `budget` bytes of RAM per rank (host_budget_bytes): first on optimizer states
    (each byte kept saves a byte read and a byte written in the step itself), whole units spread over the
    walk (spread_units); the gradient shard stays in RAM with grad_device auto only when every state does and
    it fits beside them (its write happens during backward, its read in the step). What must be in RAM whatever the budget (the ring
    for streamed pieces, the gradient buffers or a gradient shard grad_device cpu keeps in RAM, each twice
    under delay_update) is the working set; a size below it is a UserError naming the key (auto falls back to min: the
    estimate then says whether that fits).

    `clipping`: train.grad_clip > 0 (DPU's RAM snapshot is fp32 then). `reserved`: the rank's other host memory, which the budget holds as well (planning.memory's
    host_reserved: on a CPU-only host the "device" working set, parameters offloaded to CPU, pinned staging;
    and what speculation holds in RAM beside the split: planning/speculation_costs.spending, with
    second_slots.speculation_ram_bytes), so that the whole rank stays within the budget; the tier keeps what is left, and only its working set
    when that is less. Placement only: every tier computes the same numbers."""
    oo = zero.offload_optimizer
    if policy.offload_optimizer != "nvme":
        return DiskSplit()
    sizes = piece_bytes(plan, subgroup_of(zero))  # the states' bytes (what the split reports)
    ram = piece_ram(plan, subgroup_of(zero))  # what each takes in RAM (what the budget pays)
    ram_forced = oo.grad_device == "cpu"
    disk_forced = oo.grad_device == "nvme"
    itemsize = 4 if policy.shard_accum_fp32(accumulating) else DTYPES[precision].itemsize
    numel = sum(u.shard for u in plan.units)
    # DPU's delayed step reads the shard while the next backward writes the next one: in RAM beside it a
    # snapshot (in fp32 when `clipping` or fp16 rescale it, as footprint.model_states counts it), on disk a second
    # file with its own buffers
    snapshot = 4 if clipping or precision == "fp16" else itemsize
    shard = itemsize * numel + (snapshot * numel if oo.delay_update else 0)
    buffers = grad_buffer_bytes(plan, itemsize) * (2 if oo.delay_update else 1)
    if budget is None:
        return DiskSplit((), len(sizes), not ram_forced, None, 0, sum(sizes))
    states, left = sum(sizes), budget - reserved
    if not disk_forced and sum(ram) + shard <= left:
        return DiskSplit(tuple(range(len(sizes))), len(sizes), False, budget, states, states, reserved)
    grads = shard if ram_forced else buffers
    if sum(ram) + grads <= left:
        return DiskSplit(
            tuple(range(len(sizes))), len(sizes), not ram_forced, budget, states, states, reserved
        )
    ring = ring_size(len(sizes)) * max(ram)
    room = budget - grads - ring
    if room < 0 and oo.host_budget.strip().lower() == "auto":  # a small host: the working set, as min
        return DiskSplit((), len(sizes), not ram_forced, None, 0, sum(sizes))
    if room < 0:
        what = "gradient shard" if ram_forced else "gradient buffers"
        raise UserError(
            f"zero.offload_optimizer.host_budget: {human(budget)} per rank cannot hold the disk tier's working "
            f"set, {human(grads + ring)} (the ring of sub-group buffers {human(ring)} and the {what} "
            f"{human(grads)}); give at least that, or min"
        )
    room -= reserved  # below the working set: the working set alone (every state streamed)
    resident = spread_units(ram, unit_pieces(plan, subgroup_of(zero)), room)
    kept = sum(sizes[k] for k in resident)
    return DiskSplit(resident, len(sizes), not ram_forced, budget, kept, states, reserved)


def spread_units(ram: list[int], units: list[range], room: int) -> tuple[int, ...]:
    """The resident pieces: whole units (so that their parameter shards need no disk either:
    traffic.master_served_units) spread evenly over the walk, at most `room` bytes of RAM. A unit is kept when
    what is kept so far, with half of it, stays within the room's share of what the walk has passed.

    Why spread: a resident piece costs the walk only its CPU Adam, which, between streamed pieces, runs while
    the disk reads the next ones ahead; kept first, the walk stepped them all with the disk idle, then waited
    on the disk for the rest (the 3.4B demo: the walk's first 1.8 s)."""
    total = sum(ram)
    share = room / total if total else 0.0
    kept = seen = 0
    out: list[int] = []
    for pieces in units:
        r = sum(ram[pieces.start : pieces.stop])  # (a unit's pieces are consecutive)
        seen += r
        if r and kept + r <= room and kept + r / 2 <= share * seen:
            out.extend(pieces)
            kept += r
    return tuple(out)


# History: until 0403c7f the budget kept the walk's first pieces. Spread then (measured on the 3.4B demo
# without overlap_step, 6 steps, separate runs) made the optimizer phase 24 s against 20 s, the resident
# pieces' parameter write-backs waiting 3.0 s against 0.1 s in the streamed pieces' traffic; served from their
# masters since, resident units write nothing, and spread is the faster (docs/benchmarks.md, "Beyond memory").
