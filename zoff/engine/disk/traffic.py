"""The disk tier's traffic per step and what the host budget spares it: the bytes each step reads and writes
(`zoff estimate`'s disk columns and its predicted step), the units gathered from masters the budget keeps in
RAM (master_served_units: the engine wires them, the estimate leaves their parameter I/O out), and the host
buffers the overlapped step holds. Pure functions of the plan, the policy, the config and the DiskSplit, so the
engine and the estimate read the same rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zoff.config import ZeroConfig
from zoff.engine.disk.param_swap import HELD_UNITS, MAX_WRITES, SPARES
from zoff.engine.disk.placement import next_params_bytes, piece_bytes, subgroup_of, unit_pieces
from zoff.engine.disk.swapfile import aligned
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy
from zoff.engine.precision import DTYPES

if TYPE_CHECKING:
    from zoff.engine.disk.placement import DiskSplit


def disk_traffic(
    plan: PartitionPlan, policy: Policy, subgroup: int | None, precision: str, micro_batches: int,
    grads: int = 0, split: DiskSplit | None = None, overlap: bool = False, delay_update: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """(bytes read, bytes written) per rank per step by the disk tier: every optimizer piece `split` does not
    keep in RAM once each way;
    the gradient swap file (`grads` bytes, grad_disk_bytes) written by every micro-batch, read back by every
    one after the first (they accumulate on disk) and by the step; under parameter offload to nvme each
    micro-batch reads a block's shard for its forward and again for its backward (the root's units once, held
    from forward to backward), and the step writes back the trainable shards, all but master_served_units'.

    `overlap` (zero.offload_optimizer.overlap_step): the first forward trails the walk and takes a unit's
    shard from its held write-back (param_swap.SwappedShards.held) where the walk waits on the disk, the
    units whose last piece is streamed; where that piece is resident the walk (only CPU Adam there) may
    overtake the forward's two held units, and the forward reads the disk (a unit resident whole reads
    nothing: master_served_units). A model of timing, not a count: the 3.4B demo measured within 0.5% of it
    at two budgets (docs/benchmarks.md).

    `delay_update` (DPU): the same walk, in the background; what it cannot publish from there is read back
    once it is done."""
    # every piece's three states, each read and written whole pages (not the file's header)
    resident = set(split.resident) if split is not None else set()
    sizes = piece_bytes(plan, subgroup) if policy.offload_optimizer == "nvme" else ()
    opt = sum(sizes) - sum(sizes[k] for k in resident)
    opt_r, opt_w = opt + micro_batches * grads, opt + micro_batches * grads
    # DPU with the parameters in memory: the walk writes the new shards to a file of their own, read back
    # once it is done (ZeroEngine.flush); on disk they go to the parameter file's other slot instead
    nxt = next_params_bytes(plan, policy, precision, delay_update)
    opt_r, opt_w = opt_r + nxt, opt_w + nxt
    if not policy.params_on_disk:
        return opt_r, opt_w
    c = DTYPES[precision].itemsize
    sharded = [u for u in plan.all_units if not u.persistent]
    cast = master_served_units(plan, policy, subgroup, split, delay_update)
    sharded = [u for u in sharded if u.index not in cast]  # no parameter I/O for them
    reads = sum(aligned(c * u.shard) * (1 if u.modules == ("",) else 2) for u in sharded)
    written = sum(aligned(c * u.shard) for u in sharded if u.index < len(plan.units))
    held = 0
    if overlap and policy.offload_optimizer == "nvme":
        pieces = unit_pieces(plan, subgroup)
        held = sum(
            aligned(c * u.shard)
            for u in sharded
            if u.index < len(plan.units) and pieces[u.index] and pieces[u.index][-1] not in resident
        )
    return opt_r + micro_batches * reads - held, opt_w + written


def master_served_units(
    plan: PartitionPlan, policy: Policy, subgroup: int | None, split: DiskSplit | None, delay_update: bool
) -> frozenset[int]:
    """Under parameter offload to nvme, the trainable units whose optimizer pieces the host budget keeps in
    RAM, all of them: their gathers cast the 16-bit shard from the resident fp32 master (the same cast the
    step's write-back makes, so the same bits) and the step writes nothing back, so their parameter shards
    cost no disk I/O at all (the 3.4B demo at the default budget: 3.1 GB read and 3.4 GB written per step
    less, on the disk that bounds the step). Their regions of the parameter swap file stay (a later budget
    may stream them). Not under delay_update: its forward runs on the parameters before the master's
    update in flight."""
    if not policy.params_on_disk or split is None or not split.resident or delay_update:
        return frozenset()
    resident = set(split.resident)
    return frozenset(
        u.index
        for u, pieces in zip(plan.units, unit_pieces(plan, subgroup), strict=True)
        if pieces and not u.persistent and resident.issuperset(pieces)
    )


def held_write_back_bytes(
    plan: PartitionPlan, policy: Policy, zero: ZeroConfig, precision: str, split: DiskSplit | None = None
) -> int:
    """Host bytes of the overlapped step's held parameter write-backs: param_swap.HELD_UNITS units' shards,
    and one more (the unit a gather is copying out while the walk holds the next ones), the largest ones
    written back (not master_served_units', which write nothing under `split`); only with parameters on disk
    and zero.offload_optimizer.overlap_step. Under delay_update (parameters on disk) the delayed step's write
    buffers and kept pieces instead, which live beside the next forward and backward."""
    c = DTYPES[precision].itemsize
    if zero.offload_optimizer.delay_update and policy.offload_optimizer == "nvme":
        # DPU's step writes beside forward and backward: its write-back buffers (MAX_WRITES in flight, the one
        # being filled and the SPARES kept) of its largest piece, and the persistent units' kept pieces; with
        # the parameters in memory every unit's pieces go to the file that flush() reads back, two units at a time
        on_disk = policy.params_on_disk
        piece = max(
            (min(u.shard, subgroup_of(zero)) for u in plan.units if not (on_disk and u.persistent)), default=0
        )
        kept = (
            sum(u.shard for u in plan.units if u.persistent)
            if on_disk
            else 2 * max((u.shard for u in plan.units), default=0)
        )
        return c * ((MAX_WRITES + 1 + SPARES) * piece + kept)
    if not (zero.offload_optimizer.overlap_step and policy.params_on_disk):
        return 0
    served = master_served_units(plan, policy, subgroup_of(zero), split, zero.offload_optimizer.delay_update)
    written = (u.shard for u in plan.units if not u.persistent and u.index not in served)
    shards = sorted(written, reverse=True)[: HELD_UNITS + 1]
    return c * sum(shards)
