"""The ZeRO policy table: which stage/offload combinations exist, and every rule that follows from a policy.

One place for each rule, read by the engine when it builds and by the estimator when it predicts (so the two
cannot drift apart): which combinations are valid, how many partitions a stage makes, whether full
gradients are kept, how the partition plan is built, how many gloo receive slices a reduction needs, and the
model-state bytes each policy puts on the device and the host (ZeroEngine.planned_memory() and `zoff
estimate` both call model_states). Pure functions of the policy, the world size and the config: no process
group, no memory.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from zoff.config import ZeroConfig
from zoff.engine.disk.files import ALIGN, aligned
from zoff.engine.disk.state_swap import (
    partition_layout,
    piece_ram_bytes,
    piece_spans,
    ring_size,
    subgroup_numel,
)
from zoff.engine.partition import PartitionPlan, plan_partition
from zoff.engine.precision import DTYPES
from zoff.engine.staging import chunk_bytes, needs_staging
from zoff.engine.step.grad_store import GRAD_BUFFERS

if TYPE_CHECKING:
    from zoff.engine.disk.budget import DiskSplit


@dataclass(frozen=True)
class Policy:
    stage: int
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3 only; nvme with the optimizer on nvme too)
    activation_checkpointing: bool = False

    @classmethod
    def of(cls, zero: ZeroConfig, activation_checkpointing: bool = False) -> Policy:
        return cls(
            zero.stage, zero.offload_optimizer.device, zero.offload_param.device, activation_checkpointing
        )

    @property
    def name(self) -> str:
        """The recipe names: zero2-offload, zero3-offload (both offloads); zero3-offload-opt (optimizer only);
        likewise zero2-nvme, zero3-nvme (both on disk), zero3-nvme-opt."""
        if self.offload_optimizer == "none":
            return f"zero{self.stage}"
        if self.offload_optimizer == "nvme":
            if self.stage < 3 or self.offload_param == "nvme":
                return f"zero{self.stage}-nvme"
            return "zero3-nvme-opt" + ("+param-cpu" if self.offload_param == "cpu" else "")
        return f"zero{self.stage}-offload" + (
            "-opt" if self.stage == 3 and self.offload_param == "none" else ""
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------------------------------- rules
    def invalid(self) -> tuple[str, str] | None:
        """(config key, why) when the engine cannot run this policy; None when it can."""
        if self.offload_param != "none" and self.stage != 3:
            return "zero.offload_param.device", "parameter offload needs zero.stage 3"
        if self.offload_param != "none" and self.offload_optimizer == "none":
            return (
                "zero.offload_param.device",
                "parameter offload needs zero.offload_optimizer.device cpu or nvme",
            )
        if self.offload_param == "nvme" and self.offload_optimizer != "nvme":
            return (
                "zero.offload_param.device",
                "parameter offload to nvme needs zero.offload_optimizer.device nvme",
            )
        if self.offload_optimizer != "none" and self.stage == 0:
            return "zero.offload_optimizer.device", "optimizer offload needs zero.stage 1, 2 or 3"
        return None

    @property
    def keeps_full_grads(self) -> bool:
        """Stages 0-1 accumulate whole gradients in persistent flat buffers; 2-3 keep only the reduced shard.

        Under optimizer offload stage 1 reduces like stage 2: every micro-batch's gradient leaves the device
        for the tier's shard as soon as it is reduced, so the device keeps no Psi-sized gradient (zero1- and
        zero2-offload then hold and compute the same; their difference is the device's, and it is gone)."""
        return self.stage == 0 or (self.stage == 1 and not self.offloads_optimizer)

    @property
    def all_reduces(self) -> bool:
        """Stage 0 is plain data parallelism: whole gradients all-reduced, every rank holds the full norm."""
        return self.stage == 0

    @property
    def partitioned(self) -> bool:
        """Stages 1-3 split the optimizer state (and more) N ways; stage 0 keeps one partition every rank owns."""
        return self.stage >= 1

    @property
    def shards_params(self) -> bool:
        """Stage 3: parameters live as shards, gathered around the modules that use them."""
        return self.stage == 3

    def gathers_after_step(self, persistent: bool) -> bool:
        """Whether a unit's updated shard is all-gathered into its full buffer right after the step: stages 1-2
        always, stage 3 only its persistent (small, always gathered) units, stage 0 never (nothing split)."""
        return self.stage in (1, 2) or (self.shards_params and persistent)

    def shard_accum_fp32(self, accumulating: bool) -> bool:
        """Stages 2-3 reduce every micro-batch into the gradient shard: in fp32 when micro-batches accumulate
        (2 B/param/N more under 16-bit compute; a bf16 sum of many micro-batches loses the small ones)."""
        return accumulating and not self.keeps_full_grads

    @property
    def offloads_optimizer(self) -> bool:
        """Optimizer states off the device: in host memory (cpu) or on local disk (nvme)."""
        return self.offload_optimizer != "none"

    @property
    def offloads_params(self) -> bool:
        """Stage 3's parameter shards in host memory (on a host-only machine: where they are anyway)."""
        return self.offload_param == "cpu"

    @property
    def params_on_disk(self) -> bool:
        """Stage 3's non-persistent parameter shards in a swap file, read for each gather (param_swap.py)."""
        return self.offload_param == "nvme"

    def partitions(self, world: int) -> int:
        """Stage 0 is one partition that every rank owns; stages 1-3 split everything N ways."""
        return world if self.stage >= 1 else 1

    def rank_in_partition(self, rank: int) -> int:
        return rank if self.stage >= 1 else 0

    def receive_slices(self, world: int) -> int:
        """gloo reduce-scatter scratch slices per reduction in flight (collectives.py): N-1 when the output is
        this rank's own slice of the input (stage 1's full buffers), N-2 otherwise; stage 0 all-reduces in place."""
        if self.stage == 0:
            return 0
        return max(0, world - (1 if self.keeps_full_grads else 2))


def _valid(ac: bool) -> list[Policy]:
    stages = range(4)
    combos = [(s, o, p) for s in stages for o in ("none", "cpu", "nvme") for p in ("none", "cpu", "nvme")]
    return [pol for pol in (Policy(*c, ac) for c in combos) if pol.invalid() is None]


POLICIES = tuple(_valid(False) + _valid(True))  # every policy the engine accepts


# ------------------------------------------------------------------------------------------ memory terms
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
        # (DPU: two gradient files, each with its buffers: grad_store.DelayedDiskGrads)
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


def grad_buffer_bytes(plan: PartitionPlan, itemsize: int) -> int:
    """RAM of the gradient swap file's buffers (grad_store.DiskGrads): GRAD_BUFFERS of the largest unit shard."""
    return GRAD_BUFFERS * aligned(max((itemsize * u.shard for u in plan.units), default=1))


def grad_disk_bytes(
    plan: PartitionPlan, policy: Policy, split: DiskSplit, accumulating: bool, precision: str,
    delayed: bool = False,
) -> int:  # fmt: skip
    """The gradient swap file per rank (grad_store.DiskGrads): an aligned region per unit, in fp32 when
    micro-batches accumulate; two such files when `delayed` (DPU: grad_store.DelayedDiskGrads); 0 unless the
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
    return tuple(3 * aligned(4 * (hi - lo)) for n in shards for lo, hi in piece_spans(n, subgroup))


@functools.lru_cache(maxsize=64)
def _piece_ram(shards: tuple[int, ...], subgroup: int | None) -> tuple[int, ...]:
    return tuple(piece_ram_bytes(n // 3) for n in _piece_bytes(shards, subgroup))  # (three states of n // 3)


def swap_buffer_bytes(
    plan: PartitionPlan, subgroup: int | None = None, split: DiskSplit | None = None
) -> int:
    """The disk tier's states in RAM (state_swap.SwappedStates): `split`'s resident pieces (held whole), and,
    unless every piece is resident, up to ring_size (five) page-aligned ring buffers of the largest other
    piece's master, exp_avg and exp_avg_sq (stepped, read ahead, written back)."""
    sizes = piece_ram(plan, subgroup)
    resident = set(split.resident) if split is not None else set()
    streamed = [n for k, n in enumerate(sizes) if k not in resident]
    ring = ring_size(len(streamed)) * max(streamed) if streamed else 0
    return sum(n for k, n in enumerate(sizes) if k in resident) + ring


def piece_bytes(plan: PartitionPlan, subgroup: int | None) -> list[int]:
    """Disk bytes each way per step of each piece's three states, whole pages each."""
    return list(_piece_bytes(tuple(u.shard for u in plan.units), subgroup))


def piece_ram(plan: PartitionPlan, subgroup: int | None) -> list[int]:
    """RAM of each piece's three states (state_swap.piece_ram_bytes: set apart in the cache's sets)."""
    return list(_piece_ram(tuple(u.shard for u in plan.units), subgroup))


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
    """The optimizer's swap file per rank: its checkpoint shard's layout (state_swap.partition_layout)."""
    if policy.offload_optimizer != "nvme":
        return 0
    return _layout_bytes(tuple(u.shard for u in plan.units))


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
    out, first = [], 0
    for u in plan.units:
        n = len(piece_spans(u.shard, subgroup))
        out.append(range(first, first + n))
        first += n
    return out


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


def engine_plan(model: nn.Module, stage: int, world: int, zero: ZeroConfig) -> PartitionPlan:
    """The partition plan ZeroEngine builds for this stage, world size and config (also the estimate's)."""
    return plan_partition(
        model,
        Policy(stage).partitions(world),
        zero.reduce_bucket_size,
        per_block=stage == 3,
        persistence_threshold=zero.param_persistence_threshold,
        block_classes=tuple(zero.block_classes),
    )
