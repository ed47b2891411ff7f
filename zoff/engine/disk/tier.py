"""The disk tier (ZeRO-Infinity's NVMe offload): the host tier with its optimizer states in a swap file
(state_swap.SwappedStates) and, as the placement says (placement.disk_split), its gradient shard in one of its
own (grad_swap.DiskGrads)."""

from __future__ import annotations

from pathlib import Path

import torch

from zoff.engine.disk.grad_swap import DelayedDiskGrads, DiskGrads
from zoff.engine.disk.param_swap import SwappedShards
from zoff.engine.disk.state_swap import SwappedStates
from zoff.engine.staging import Staging
from zoff.engine.step.grad_store import GradShards
from zoff.engine.step.tiers import HostTier, host_buffer


class DiskTier(HostTier):
    """Optimizer states in a swap file on local disk (ZeRO-Infinity's NVMe offload); host memory holds only a
    ring of piece buffers and the pieces the host budget keeps. Gradients and parameters move as for the host
    tier; the other pieces stream: the next ones are read while one is stepped and the previous ones are
    written back (SwappedStates)."""

    kind = "disk"

    def __init__(
        self, staging: Staging | None, grad_dtype: torch.dtype, copy_grads: bool, swap_dir: Path, threads: int,
        request_mb: int, piece: int | None = None, params: SwappedShards | None = None, grads_on_disk: bool = True,
        resident: tuple[int, ...] = (), delayed: bool = False, speculated: frozenset[int] = frozenset(),
    ):  # fmt: skip
        super().__init__(staging, grad_dtype, alias_masters=False, copy_grads=copy_grads)
        self.delayed = delayed  # DPU (delay_update): gradients on disk alternate between two files
        self.swap_dir, self.threads, self.request_mb, self.piece = swap_dir, threads, request_mb, piece
        self.params = params  # parameter offload to nvme: where the shards that are not in memory are
        self.grads_on_disk = (
            grads_on_disk  # grad_device and host_budget (placement.disk_split): its own swap file
        )
        self.resident = resident  # the host budget's pieces of the states, held in RAM (placement.disk_split)
        self.speculated = speculated  # pieces with a second slot (disk/second_slots.py)

    def grad_store(self, numels: list[int], dtype: torch.dtype, device: torch.device) -> GradShards:
        if not self.grads_on_disk:
            return super().grad_store(numels, dtype, device)

        def make(name: str) -> DiskGrads:
            return DiskGrads(
                numels, dtype, self.swap_dir, threads=self.threads, request_bytes=self.request_mb << 20,
                staging=self.staging, name=name,
            )  # fmt: skip

        # DPU: the delayed step reads one gradient file while the next backward writes the other
        return DelayedDiskGrads(make) if self.delayed else make("grads.swap")

    def make_states(self, shards: list[torch.Tensor]) -> SwappedStates:
        if self.copy_grads:  # as the host tier: DPU's snapshot of the gradient shard
            self.host_grads += [host_buffer(s, self.grad_dtype, pin=False) for s in shards]
        return SwappedStates(
            shards, self.swap_dir, self._download, threads=self.threads, request_bytes=self.request_mb << 20,
            piece=self.piece, source=self._live_shard(shards), resident=self.resident,
            speculated=self.speculated,
        )  # fmt: skip

    def _live_shard(self, shards: list[torch.Tensor]):
        """Unit i's live shard for its initial master: in memory, or read from the parameter swap file (one
        unit's copy held at a time: the pieces of a unit come one after the other)."""
        last: dict[int, torch.Tensor] = {}

        def source(i: int) -> torch.Tensor:
            if not shards[i].is_meta:
                return shards[i]
            if i not in last:
                last.clear()
                last[i] = self.params.load(i)
            return last[i]

        return source
