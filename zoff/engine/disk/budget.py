"""The disk tier's host budget (zero.offload_optimizer.host_budget): what of its states and gradients stays in
RAM so that the disk holds only what RAM cannot. A pure value (DiskSplit) computed by one function from the
partition plan, the config and the budget, read by the engine when it builds its tiers and by the estimate,
so the RAM and the disk bytes per step `zoff estimate` prints are what the engine allocates and moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zoff.config import ZeroConfig
from zoff.config.sections import OffloadOptimizerConfig
from zoff.engine.disk.state_swap import ring_size
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy, grad_buffer_bytes, piece_bytes, piece_ram, subgroup_of, unit_pieces
from zoff.engine.precision import DTYPES
from zoff.errors import UserError
from zoff.units import human, parse_size

# auto keeps max(AUTO_MARGIN_MIN + AUTO_MARGIN_PER_RANK per local rank, AUTO_MARGIN_FRACTION) of the host for
# what the budget does not count: the OS and the page cache of the data (the minimum), the launcher, and per
# rank its interpreter and allocator slack (the 3.4B demo at host_budget=2GiB peaked 0.75 GiB above it). The
# rank's activations, gathered blocks and staging are inside the budget (disk_split's `reserved`). Every byte
# kept back costs a byte read and a byte written per step: 25% (the first margin) left 5.7 GiB of this
# 24 GiB machine idle while the disk was the step's bottleneck.
AUTO_MARGIN_FRACTION, AUTO_MARGIN_MIN, AUTO_MARGIN_PER_RANK = 0.125, 2 << 30, 768 << 20


def mem_total() -> int:
    """This host's MemTotal (/proc/meminfo), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise UserError(
        "/proc/meminfo has no MemTotal: give zero.offload_optimizer.host_budget as a size (zoff estimate: --cpu-memory)"
    )


def host_budget_bytes(oo: OffloadOptimizerConfig, host_bytes: int, local_ranks: int) -> int | None:
    """zero.offload_optimizer.host_budget in bytes per rank: auto is `host_bytes` (a node's memory) less
    max(AUTO_MARGIN_MIN + AUTO_MARGIN_PER_RANK x local_ranks, AUTO_MARGIN_FRACTION of it), split over the
    node's ranks; None for min."""
    text = oo.host_budget.strip().lower()
    if text == "min":
        return None
    if text == "auto":
        ranks = max(1, local_ranks)
        margin = max(AUTO_MARGIN_MIN + ranks * AUTO_MARGIN_PER_RANK, int(AUTO_MARGIN_FRACTION * host_bytes))
        return max(0, host_bytes - margin) // ranks
    return parse_size(oo.host_budget, "zero.offload_optimizer.host_budget", lo=0)


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
    host_reserved: on a CPU-only host the "device" working set, parameters offloaded to CPU, pinned staging),
    so that the whole rank stays within the budget; the tier keeps what is left, and only its working set
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
    # snapshot (in fp32 when `clipping` or fp16 rescale it, as policy.model_states counts it), on disk a second
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
    disk_traffic.master_served_units) spread evenly over the walk, at most `room` bytes of RAM. A unit is kept when
    what is kept so far, with half of it, stays within the room's share of what the walk has passed.

    Why spread: a resident piece costs the walk only its CPU Adam, which, between streamed pieces, runs while
    the disk reads the next ones ahead; kept first, the walk stepped them all with the disk idle, then waited
    on the disk for the rest (the 3.4B demo: the walk's first 1.8 s)."""
    total = sum(ram)
    share = room / total if total else 0.0
    kept = seen = 0
    out: list[int] = []
    for pieces in units:
        r = sum(ram[k] for k in pieces)
        seen += r
        if r and kept + r <= room and kept + r / 2 <= share * seen:
            out.extend(pieces)
            kept += r
    return tuple(out)


# History: until 0403c7f the budget kept the walk's first pieces. Spread then (measured on the 3.4B demo
# without overlap_step, 6 steps, separate runs) made the optimizer phase 24 s against 20 s, the resident
# pieces' parameter write-backs waiting 3.0 s against 0.1 s in the streamed pieces' traffic; served from their
# masters since, resident units write nothing, and spread is the faster (docs/benchmarks.md, "Beyond memory").
