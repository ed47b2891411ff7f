"""Stage 2/3's transient device buffers: gradients awaiting their reduction, gloo's receive slices, and stage 3's
gathered working set. Pure functions of the engine's partition plan (the same plan ZeroEngine builds), which
memory.estimate() adds to each policy's model states.
"""

from __future__ import annotations

from torch import nn

from zoff.config import ZeroConfig
from zoff.engine.comm.reduce import MAX_IN_FLIGHT
from zoff.engine.partition import PartitionPlan, layer_lists
from zoff.engine.policy import Policy
from zoff.engine.precision import DTYPES


def device_buffers(
    plan: PartitionPlan,
    policy: Policy,
    zero: ZeroConfig,
    precision: str,
    device_type: str = "cuda",
    accumulating: bool = False,
) -> int:
    """Transient device buffers: gradients awaiting reduction, reduce-scatter receive slices, stage 3's gathered set.

    The receive slices are gloo's (collectives.py; NCCL's native reduce-scatter needs none): N-1 slices of a
    unit's shard for stage 1 without offload (its output is its own slice of the full gradient), N-2 for
    stages 2-3 and for stage 1 under offload, for each reduction in flight.
    """
    c = DTYPES[precision].itemsize
    shards = sorted((u.shard for u in plan.units), reverse=True)
    out = pending_gradients(plan, policy, precision, accumulating, zero.overlap_comm, device_type)
    if device_type == "cpu":  # gloo's receive slices
        out += c * policy.receive_slices(plan.world_size) * sum(shards[: MAX_IN_FLIGHT + 1])
    if policy.stage == 3:
        out += c * stage3_working_set(plan, zero)
    return out


def pending_gradients(
    plan: PartitionPlan, policy: Policy, precision: str, accumulating: bool, overlap: bool,
    device_type: str = "cuda",
) -> int:  # fmt: skip
    """Stage 2/3 gradient bytes waiting for their reduction (engine/comm/reduce.py), beside the sharded accumulator
    (and stage 1's under optimizer offload, which reduces as stage 2 does).

    The unit filling plus MAX_IN_FLIGHT being reduced (one when overlap_comm is off): pooled buckets on NCCL,
    autograd's own gradients on gloo; a reduced shard on its way into the accumulator per reduction in flight
    when accumulating, or when the accumulator is off the device (offload on a GPU: it lands in host memory
    or on disk through the staging); at stage 3 also most of the root unit. A unit held back by an earlier one in the
    fixed reduction order (a parameter no data used yet) keeps its gradients until the end of backward:
    data-dependent models can exceed this.
    """
    if policy.keeps_full_grads:
        return 0
    stage = policy.stage
    off_device = policy.offloads_optimizer and device_type != "cpu"
    c = DTYPES[precision].itemsize
    n = MAX_IN_FLIGHT + 1 if overlap else 1
    # Stage 3's root unit is reduced last, when its embeddings' gradients arrive, but an untied head's and the
    # final norm's come first: all of the root but its largest parameter is held beside the blocks'.
    root = [u for u in plan.units if stage == 3 and u.modules == ("",)]
    early = sum(u.numel for u in root) - max(
        (plan.slots[si].numel for u in root for si in u.slots), default=0
    )
    sizes = sorted((u.padded for u in plan.units if stage < 3 or u.modules not in (("",), ())), reverse=True)
    # Persistent units (small parameters of every block) are reduced last too: held through backward.
    early += sum(u.padded for u in plan.units if stage == 3 and u.persistent)
    held = max(early + sum(sizes[:n]), sum(u.padded for u in root))
    shards = sorted((u.shard for u in plan.units), reverse=True)
    return c * (held + (n * shards[0] if accumulating or off_device else 0))


def stage3_working_set(plan: PartitionPlan, zero: ZeroConfig) -> int:
    """Elements gathered at once in stage 3 (an upper bound; engine/comm/gather.py).

    The root unit (gathered from the start of forward to the end of backward), the block in use and the one
    whose gradients are still arriving when the next is gathered, and prefetch: up to prefetch_bucket_size
    ahead plus what an earlier prefetch already started (with parameters on disk, at least the next block). A recomputed block (activation checkpointing) is the
    block in use: it gathers nothing more.
    """
    blocks: dict[str, int] = {}
    for u in plan.all_units:  # a block's trainable and frozen units are gathered together
        if not u.persistent:
            blocks[u.modules[0]] = blocks.get(u.modules[0], 0) + u.padded
    root = blocks.pop("", 0)
    sizes = sorted(blocks.values(), reverse=True)
    ahead = 2 * zero.prefetch_bucket_size
    if zero.offload_param.device == "nvme":  # the next block is read ahead whatever the bucket size
        ahead = max(ahead, sizes[0] if sizes else 0)
    return root + sum(sizes[:2]) + min(ahead, sum(sizes[2:]))


def finer_gathering(model: nn.Module, linear: bool = True) -> list[tuple[str, ...]]:
    """zero.block_classes that gather stage 3's layers part by part, coarsest first: the classes of a layer's
    parts that hold a tenth of its parameters or more (attention and MLP; the norms go with the root; offered
    when no Linear is a direct child of the layer), then, with `linear`, every Linear of the layers
    (partition.find_blocks). The first layer list is the model's layers (a model with two, a vision tower
    first, is judged by that one). None for layers that hold a list of their own (experts): an expert that
    some rank's tokens skip would be a block that rank does not gather, which stage 3 refuses.

    Whole layers are gathered two at a time in backward, the one in use and the one whose gradients are still
    arriving, plus the prefetch: 6 GiB each in bf16 for a 16384-wide layer (405B), more than its activations.
    Finer units gather as much per step in more, smaller collectives; a Linear inside a tiled MLP is gathered
    once per tile (so the caller leaves `linear` out when train.mlp_tile cuts a micro-batch in several), so
    the estimate takes the coarsest that fits, and only where whole layers do not.
    """
    lists = layer_lists(model)
    if not lists or any(m is not lists[0][0] and isinstance(m, nn.ModuleList) for m in lists[0][0].modules()):
        return []
    layer = lists[0][0]
    total = sum(p.numel() for p in layer.parameters())
    parts = tuple(dict.fromkeys(
        type(c).__name__ for c in layer.children() if 10 * sum(p.numel() for p in c.parameters()) >= total
    ))  # fmt: skip
    out = [parts] if parts and not any(isinstance(c, nn.Linear) for c in layer.children()) else []
    if linear and any(isinstance(m, nn.Linear) for m in layer.modules()):
        out.append(("Linear",))
    return out
