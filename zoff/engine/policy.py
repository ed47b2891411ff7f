"""The ZeRO policy table: which stage/offload combinations exist, and every rule that follows from a policy.

One place for each rule, read by the engine when it builds and by the estimator when it predicts (so the two
cannot drift apart): which combinations are valid, how many partitions a stage makes, whether full
gradients are kept, how the partition plan is built, how many gloo receive slices a reduction needs. The bytes
each policy puts where are footprint.py's (the device and host) and disk/placement.py's (the disk tier's).
Pure functions of the policy, the world size and the config: no process group, no memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from zoff.config import ZeroConfig
from zoff.engine.partition import PartitionPlan, plan_partition


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
