"""The model-state bytes each policy puts where: on the device, in host memory (model_states, the very function
ZeroEngine.planned_memory() and `zoff estimate` both call, so the two cannot drift apart), the frozen
parameters, the staging and pinned buffers, and plain data parallelism's for comparison. Pure functions of
the policy (policy.py), the partition plan and the config; the disk tier's own bytes are its placement's
(disk/placement.py).
"""

from __future__ import annotations

import torch
from torch import nn

from zoff.config import ZeroConfig
from zoff.engine.disk.placement import DiskSplit, grad_buffer_bytes, swap_buffer_bytes
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy
from zoff.engine.precision import DTYPES
from zoff.engine.staging import chunk_bytes, needs_staging


def frozen_param_bytes(
    model: nn.Module, plan: PartitionPlan, precision: str, policy: Policy | None = None
) -> int:
    """Frozen parameters one rank holds on its device, in the compute dtype: those kept whole, and stage 3's
    shards of the others unless parameter offload keeps them with the trainable shards (host memory: counted
    by model_states; disk). A LoRA base is most of the model: where its shards live is most of the memory."""
    whole = set(plan.frozen)
    numel = sum(p.numel() for n, p in model.named_parameters() if n in whole)
    offloaded = policy is not None and policy.offload_param != "none"
    shards = 0 if offloaded else sum(u.shard for u in plan.frozen_units)
    return DTYPES[precision].itemsize * (numel + shards)


def model_states(
    plan: PartitionPlan,
    policy: Policy,
    precision: str,
    *,
    frozen_bytes: int = 0,
    device_type: str = "cuda",
    fp32_grad_staging: bool = True,
    delay_update: bool = False,
    accumulating: bool = False,
    subgroup: int | None = None,
    split: DiskSplit | None = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """(device bytes, host bytes) of one rank's params, grads and optimizer states, as ZeroEngine allocates them.

    The device numbers equal memory_report()'s params (+ frozen_params), grads and optimizer_states; the host
    numbers its cpu_params, cpu_grads and cpu_optimizer_states. Stage 3 reports persistent units whole and
    the other units' shards. The gradient shard lives with the optimizer's states (grad_store.py), in fp32
    when micro-batches accumulate at stages 2-3: on the device without offload; in host memory under CPU
    offload; under the disk tier in its own swap file (RAM: its three unit buffers) or in host memory, as
    `split` (disk_split: offload_optimizer.grad_device and host_budget) says; the disk tier's states in RAM
    are `split`'s resident sub-groups plus its ring. DPU adds a snapshot the delayed step reads, in fp32
    when clipping or fp16 loss scaling rescales it (`fp32_grad_staging`). With parameter offload the
    non-persistent parameter shards live on the host too.
    """
    c = DTYPES[precision].itemsize
    padded = sum(u.padded for u in plan.units)
    shard = sum(u.shard for u in plan.units)
    persistent = sum(u.padded for u in plan.units if u.persistent)
    shard_np = sum(u.shard for u in plan.units if not u.persistent)
    opt_off, par_off = policy.offloads_optimizer, policy.offloads_params
    # A CPU-only run needs no host copies of what already is in host memory (the engine aliases them).
    host_is_device = device_type == "cpu" and not delay_update
    gpu = {"params": frozen_bytes, "grads": 0, "optimizer_states": 0}
    cpu = {"params": 0, "grads": 0, "optimizer_states": 0}
    if policy.stage < 3:
        gpu["params"] += c * padded
    else:
        # offloaded shards live in host memory (cpu) or in the swap file (nvme), not on the device
        gpu["params"] += c * (persistent + (0 if policy.offload_param != "none" else shard_np))
        # (stage 3's frozen shards follow the trainable ones: frozen_param_bytes counts them on the device)
        frozen_shards = sum(u.shard for u in plan.frozen_units)
        cpu["params"] = c * (shard_np + frozen_shards) if par_off else 0
    fp32_shard = policy.shard_accum_fp32(accumulating)
    grad_shard = (4 if fp32_shard else c) * shard  # the reduced shard, in its accumulator's dtype
    if policy.keeps_full_grads:  # stages 0-1 without offload: whole gradients in flat buffers
        gpu["grads"] = c * padded
    elif not opt_off:
        gpu["grads"] = grad_shard
    elif policy.offload_optimizer == "nvme" and (split is None or split.grads_on_disk):
        # (DPU: two gradient files, each with its buffers: grad_swap.DelayedDiskGrads)
        cpu["grads"] = grad_buffer_bytes(plan, 4 if fp32_shard else c) * (2 if delay_update else 1)
    else:
        cpu["grads"] = grad_shard
        if opt_off and delay_update:  # the snapshot DPU's background step reads (tiers.HostTier.to_kernel)
            cpu["grads"] += (4 if fp32_grad_staging or fp32_shard else c) * shard
    if not opt_off:  # fp32 training steps the params in place; 16-bit keeps a separate fp32 master
        gpu["optimizer_states"] = (8 + (4 if c != 4 else 0)) * shard
    elif policy.offload_optimizer == "nvme":  # the budget's resident sub-groups and the ring for the rest
        cpu["optimizer_states"] = swap_buffer_bytes(plan, subgroup, split)
    else:
        cpu["optimizer_states"] = (8 + (0 if c == 4 and host_is_device else 4)) * shard
    return gpu, cpu


def data_parallel_bytes(trainable_params: int) -> int:
    """Plain data parallelism's model states per rank (docs/zero-stages.md): 16 B/param, fp32 or mixed
    precision (a 16-bit param and gradient plus the fp32 master and both moments, or fp32 param, grad and
    moments)."""
    return 16 * trainable_params


def host_staging(policy: Policy, zero: ZeroConfig, device_type: str) -> int:
    """Host bytes of one rank's offload staging buffers (engine/staging.py): only where the device is not the host."""
    if policy.offload_optimizer == "none" or not needs_staging(torch.device(device_type)):
        return 0
    return 2 * chunk_bytes(zero.offload_optimizer.staging_mb << 20)


def pinned_host_bytes(
    plan: PartitionPlan, policy: Policy, zero: ZeroConfig, precision: str, device_type: str
) -> int:
    """Page-locked host bytes of one rank, as ZeroEngine.pinned_bytes() counts them: the staging buffers (when
    offload_optimizer.pin_memory) and stage 3's offloaded parameter shards (when offload_param.pin_memory)."""
    if device_type != "cuda":
        return 0
    staged = host_staging(policy, zero, device_type) if zero.offload_optimizer.pin_memory else 0
    shards = sum(u.shard for u in plan.all_units if not u.persistent)  # frozen shards are pinned too
    par = (
        DTYPES[precision].itemsize * shards
        if policy.offload_param == "cpu" and zero.offload_param.pin_memory
        else 0
    )
    return staged + par
