"""Storage tiers: where a rank's optimizer states live, and how gradients reach them and parameters leave them.

A tier (the Tier interface) answers for the one optimizer class (optimizer.py): make the states (each unit's
fp32 master from its live shard, zero moments: states.ResidentStates, or disk/state_swap.SwappedStates on
disk; both speak the States interface, states.py), hand the step's gradient shards to the kernel, and publish
an updated master into its live (compute-dtype) shard; plus the bytes of its own transfer buffers. The engine
never looks inside one.

Each tier also holds the rank's reduced gradient shard (grad_store.py): the device's on the device, the host
tier's in host memory, the disk tier's in a swap file of its own (or in host memory: offload_optimizer.grad_device).

- DeviceTier: states beside the shards, on the accelerator (or, on a host-only machine, in host memory);
  stepped by torch's fused AdamW.
- HostTier: ZeRO-Offload. States in pageable host memory, stepped by zoff's fused CPU Adam. Per step and rank
  the device<->host traffic is the minimum the ZeRO-Offload paper gives: the reduced gradient shard down and
  the updated 16-bit shard up, through a few pinned staging buffers (staging.py) on a GPU. On a host-only
  machine the "device" is the host: the copies vanish (buffers alias the shards) and the same code runs.
- DiskTier (disk/tier.py): the host tier with its states in a swap file on local disk, laid out as the rank's
  checkpoint shard and streamed piece by piece (a unit or a sub-group of one; disk/state_swap.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from zoff.engine.staging import Staging
from zoff.engine.step.grad_store import GradShards, ResidentGrads
from zoff.engine.step.states import ResidentStates, States


class Tier(Protocol):
    """What the optimizer and the engine ask of a storage tier."""

    kind: str  # device | host | disk
    direct: bool  # the CPU kernel may write the live 16-bit shards itself
    staging: Staging | None  # where the device is not the host: the bounded pinned transfer buffers

    def make_states(self, shards: list[torch.Tensor]) -> States: ...
    def to_kernel(self, grads: list[torch.Tensor]) -> list[torch.Tensor]: ...
    def publish(self, master: torch.Tensor, shard: torch.Tensor, ordered: bool = True) -> None: ...
    def grad_store(self, numels: list[int], dtype: torch.dtype, device: torch.device) -> GradShards: ...
    def buffer_bytes(self) -> int: ...


def host_buffer(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor shaped like `like`; pinned when a GPU will copy to/from it (page-locked, so DMA-able)."""
    pin = pin and torch.cuda.is_available()
    try:
        return torch.zeros(like.shape, dtype=dtype, device="cpu", pin_memory=pin)
    except RuntimeError as e:  # name the host buffer: a pinned-memory failure is not a device OOM
        nbytes = like.numel() * torch.empty(0, dtype=dtype).element_size()
        raise RuntimeError(
            f"zoff: cannot allocate {'pinned ' if pin else ''}host buffer of {nbytes:,} bytes: {e}"
        ) from e


class DeviceTier:
    """Optimizer states on the shards' own device."""

    kind = "device"
    staging = None
    direct = False  # the CPU kernel's write-16-bit-in-the-same-pass shortcut is the host tier's

    def zeros(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like, dtype=torch.float32)

    def master(self, shard: torch.Tensor) -> torch.Tensor:
        # fp32 training needs no separate master: the shard itself is stepped (16 B/param, not 20).
        return shard if shard.dtype == torch.float32 else shard.detach().float()

    def to_kernel(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return [g if g.dtype == torch.float32 else g.float() for g in grads]  # torch's Adam wants fp32 grads

    def publish(self, master: torch.Tensor, shard: torch.Tensor, ordered: bool = True) -> None:
        shard.copy_(master)  # on the compute stream: in order whatever `ordered` says

    def buffer_bytes(self) -> int:
        return 0

    def make_states(self, shards: list[torch.Tensor]) -> ResidentStates:
        return ResidentStates([self.master(s) for s in shards], self.zeros)

    def grad_store(self, numels: list[int], dtype: torch.dtype, device: torch.device) -> GradShards:
        """The reduced gradient shards beside the states: on the device."""
        return ResidentGrads([torch.zeros(n, dtype=dtype, device=device) for n in numels], on_device=True)


class HostTier:
    """Optimizer states in host memory (ZeRO-Offload); `staging` moves data where the device is not the host."""

    kind = "host"

    def __init__(
        self, staging: Staging | None, grad_dtype: torch.dtype, alias_masters: bool, copy_grads: bool
    ):
        self.staging, self.grad_dtype = staging, grad_dtype
        self.alias_masters = alias_masters  # fp32 on a host-only machine without DPU: the shard is the master
        # Gradients: the reduced shard lives in host memory (grad_store.py) and the step reads it where it lies,
        # unless the next backward overwrites it while the step runs (DPU): then the step reads a snapshot.
        self.copy_grads = copy_grads
        self.direct = staging is None  # shards live in host memory: the kernel may write them itself
        self.host_grads: list[torch.Tensor] = []
        self.speculate = False  # second buffers for speculative updates (the engine sets it: speculate.py)

    def zeros(self, like: torch.Tensor) -> torch.Tensor:
        return host_buffer(like, torch.float32, pin=False)  # pageable: only staging is page-locked

    def master(self, shard: torch.Tensor) -> torch.Tensor:
        if self.alias_masters:
            return shard
        master = host_buffer(shard, torch.float32, pin=False)
        self._download(shard, master)
        if self.copy_grads:  # allocated once, in the one dtype the engine hands over
            self.host_grads.append(host_buffer(shard, self.grad_dtype, pin=False))
        return master

    def to_kernel(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.copy_grads:
            return grads
        for g, host in zip(grads, self.host_grads, strict=True):
            host.copy_(g)  # host to host: the shards already came down as they were reduced
        return self.host_grads

    def publish(self, master: torch.Tensor, shard: torch.Tensor, ordered: bool = True) -> None:
        """shard <- master. `ordered`: every kernel queued after this waits for the upload (on the GPU); else
        its reader waits for its own unit (staging.mark: the overlapped step's forward)."""
        if self.staging is not None:
            self.staging.upload(master, shard)  # asynchronous: the next unit's step overlaps it
            if ordered:
                self.staging.uploads_done()  # later kernels and collectives wait for it, on the GPU
        else:
            shard.copy_(master)

    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_grads)

    def make_states(self, shards: list[torch.Tensor]) -> ResidentStates:
        return ResidentStates(
            [self.master(s) for s in shards],
            self.zeros,
            aliased=self.alias_masters,
            speculable=self.speculate,
        )

    def grad_store(self, numels: list[int], dtype: torch.dtype, device: torch.device) -> GradShards:
        """The reduced gradient shards in (pageable) host memory; reductions come down through the staging."""
        shards = [host_buffer(torch.empty(n, device="meta"), dtype, pin=False) for n in numels]
        return ResidentGrads(shards, on_device=False, staging=self.staging)

    def _download(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.staging is not None:
            self.staging.download(src, dst)
        else:
            dst.copy_(src)
