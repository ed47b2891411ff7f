"""What the estimate answers per policy, and the box it is held against: Budget (a GPU's and a node's memory,
the disk), PolicyEstimate (a policy's bytes and whether they fit) and Estimate (every policy's, for one config
and world). Plain values: memory.py computes them, gathering.py, capacity.py and context.py compare them."""

from __future__ import annotations

from dataclasses import dataclass, field

from zoff.engine.disk.placement import DiskSplit
from zoff.engine.policy import Policy
from zoff.planning.speculation_costs import Spending


@dataclass(frozen=True)
class Budget:
    """Memory to fit in. shared: no CUDA, the ranks' "GPU" is the host, so all of a node's bytes share one pool."""

    gpu: int
    cpu: int
    shared: bool = False
    gpu_source: str = "given"
    cpu_source: str = "given"
    disk: int = 0  # free bytes at zero.offload_optimizer.nvme_path (0: no disk tier to offer)


@dataclass(frozen=True)
class PolicyEstimate:
    policy: Policy
    gpu: dict[str, int]  # per rank
    cpu: dict[str, int]  # per node: the sum over its local ranks
    local_ranks: int
    pinned: int = 0  # page-locked host bytes per rank (a part of cpu: hosts cap it, and it cannot swap)
    disk: int = 0  # the disk tier's swap files per rank (nvme policies)
    disk_read: int = 0  # bytes each rank reads from them per step (optimizer states, parameter gathers)
    disk_written: int = 0  # ... and writes back per step
    disk_grads: int = 0  # the part of `disk` that is the gradient shard (offload_optimizer.grad_device)
    split: DiskSplit = DiskSplit()  # nvme: what the host budget keeps in RAM (policy.disk_split)
    grad_files: int = 1  # disk_grads is this many files, one read and written a step: two under delay_update
    disk_publish: int = 0  # DPU, parameters in memory: the new shards' file, read back after the step
    # exact speculation: the second slots (a part of `disk`) and its RAM per rank (cpu["speculation"] per node)
    speculation: Spending = Spending()
    # zero-section settings this stage-3 row assumes beyond the config's, where it does not fit as configured
    # (fit_gathering): ((key, value), ...), block_classes as a tuple
    zero_changes: tuple[tuple[str, object], ...] = ()

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_bytes_per_node(self) -> int:
        return sum(self.cpu.values())

    def fits(self, budget: Budget) -> bool:
        # an nvme policy needs a path with room for its swap files (the second slots take what is left)
        if (self.disk - self.speculation.second.disk_bytes) * self.local_ranks > budget.disk:
            return False
        if budget.shared:
            return self.local_ranks * self.gpu_bytes + self.cpu_bytes_per_node <= budget.cpu
        return self.gpu_bytes <= budget.gpu and self.cpu_bytes_per_node <= budget.cpu


@dataclass(frozen=True)
class Estimate:
    params: int  # distinct parameters (tied weights once), frozen included
    trainable_params: int
    world_size: int
    gpus_per_node: int
    nodes: int
    precision: str
    activation_method: str
    policies: tuple[PolicyEstimate, ...]
    # Today's trainer builds the whole fp32 model on each rank's host and moves it to the device before
    # sharding it: transient, but it must fit too. Keys cpu_bytes_per_node, gpu_bytes.
    startup: dict[str, int]
    notes: tuple[str, ...] = field(default=())
    # train.sequence_parallel: ranks sharing each sequence (the bytes are one rank's), and the all-to-alls'
    # buffers at their largest (a part of the activations' peak)
    sequence_parallel: int = 1
    exchange: int = 0

    def get(self, policy: Policy) -> PolicyEstimate:
        return next(p for p in self.policies if p.policy == policy)
