"""The ZeRO policy table: which stage/offload combinations exist, and every rule that follows from a policy.

One place for each rule, read by the engine when it builds and by the estimator when it predicts (so the two
cannot drift apart): which combinations are valid, how many partitions a stage makes, whether full
gradients are kept, how the partition plan is built, and how many gloo receive slices a reduction needs.
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
    offload_optimizer: str = "none"  # none | cpu
    offload_param: str = "none"  # none | cpu (stage 3 only)
    activation_checkpointing: bool = False

    @classmethod
    def of(cls, zero: ZeroConfig, activation_checkpointing: bool = False) -> Policy:
        return cls(
            zero.stage, zero.offload_optimizer.device, zero.offload_param.device, activation_checkpointing
        )

    @property
    def name(self) -> str:
        """The recipe names: zero2-offload, zero3-offload (both offloads); zero3-offload-opt (optimizer only)."""
        if self.offload_optimizer == "none":
            return f"zero{self.stage}"
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
            return "zero.offload_param.device", "parameter offload needs zero.offload_optimizer.device cpu"
        if self.offload_optimizer != "none" and self.stage == 0:
            return "zero.offload_optimizer.device", "optimizer offload needs zero.stage 1, 2 or 3"
        return None

    @property
    def keeps_full_grads(self) -> bool:
        """Stages 0-1 accumulate whole gradients in persistent flat buffers; 2-3 keep only the reduced shard."""
        return self.stage <= 1

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer == "cpu"

    @property
    def offloads_params(self) -> bool:
        return self.offload_param == "cpu"

    def partitions(self, world: int) -> int:
        """Stage 0 is one partition that every rank owns; stages 1-3 split everything N ways."""
        return world if self.stage >= 1 else 1

    def rank_in_partition(self, rank: int) -> int:
        return rank if self.stage >= 1 else 0

    def receive_slices(self, world: int) -> int:
        """gloo reduce-scatter scratch slices per reduction in flight (collectives.py): N-1 when the output is
        this rank's own slice of the input (stage 1), N-2 otherwise; stage 0 all-reduces in place."""
        if self.stage == 0:
            return 0
        return max(0, world - (1 if self.stage == 1 else 2))


def _valid(ac: bool) -> list[Policy]:
    stages = range(4)
    combos = [(s, o, p) for s in stages for o in ("none", "cpu") for p in ("none", "cpu")]
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
    )
