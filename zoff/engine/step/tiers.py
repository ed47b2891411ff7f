"""Storage tiers: where a rank's optimizer states live, and how gradients reach them and parameters leave them.

A tier answers for the one optimizer class (optimizer.py): make the states (each unit's fp32 master from its
live shard, zero moments: ResidentStates, or state_swap.SwappedStates on disk), hand the step's gradient
shards to the kernel, and publish an updated master into its live (compute-dtype) shard; plus the bytes of
its own transfer buffers. The engine never looks inside one.

Each tier also holds the rank's reduced gradient shard (grad_store.py): the device's on the device, the host
tier's in host memory, the disk tier's in a swap file of its own (or in host memory: offload_optimizer.grad_device).

- DeviceTier: states beside the shards, on the accelerator (or, on a host-only machine, in host memory);
  stepped by torch's fused AdamW.
- HostTier: ZeRO-Offload. States in pageable host memory, stepped by zoff's fused CPU Adam. Per step and rank
  the device<->host traffic is the minimum the ZeRO-Offload paper gives: the reduced gradient shard down and
  the updated 16-bit shard up, through a few pinned staging buffers (staging.py) on a GPU. On a host-only
  machine the "device" is the host: the copies vanish (buffers alias the shards) and the same code runs.
- DiskTier: the host tier with its states in a swap file on local disk, laid out as the rank's checkpoint
  shard and streamed piece by piece (a unit or a sub-group of one; state_swap.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from zoff.engine.disk.param_swap import SwappedShards
from zoff.engine.disk.state_swap import KINDS, SwappedStates
from zoff.engine.staging import Staging
from zoff.engine.step.grad_store import DelayedDiskGrads, DiskGrads, GradShards, ResidentGrads


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

    def publish(self, master: torch.Tensor, shard: torch.Tensor) -> None:
        shard.copy_(master)

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

    def publish(self, master: torch.Tensor, shard: torch.Tensor) -> None:
        if self.staging is not None:
            self.staging.upload(master, shard)  # asynchronous: the next unit's step overlaps it
            self.staging.uploads_done()  # later kernels and collectives wait for it, on the GPU
        else:
            shard.copy_(master)

    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_grads)

    def make_states(self, shards: list[torch.Tensor]) -> ResidentStates:
        return ResidentStates([self.master(s) for s in shards], self.zeros)

    def grad_store(self, numels: list[int], dtype: torch.dtype, device: torch.device) -> GradShards:
        """The reduced gradient shards in (pageable) host memory; reductions come down through the staging."""
        shards = [host_buffer(torch.empty(n, device="meta"), dtype, pin=False) for n in numels]
        return ResidentGrads(shards, on_device=False, staging=self.staging)

    def _download(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.staging is not None:
            self.staging.download(src, dst)
        else:
            dst.copy_(src)


class DiskTier(HostTier):
    """Optimizer states in a swap file on local disk (ZeRO-Infinity's NVMe offload); host memory holds only a
    ring of piece buffers and the pieces the host budget keeps. Gradients and parameters move as for the host
    tier; the other pieces stream: the next ones are read while one is stepped and the previous ones are
    written back (SwappedStates)."""

    kind = "disk"

    def __init__(
        self, staging: Staging | None, grad_dtype: torch.dtype, copy_grads: bool, swap_dir: Path, threads: int,
        request_mb: int, piece: int | None = None, params: SwappedShards | None = None, grads_on_disk: bool = True,
        resident: tuple[int, ...] = (), delayed: bool = False,
    ):  # fmt: skip
        super().__init__(staging, grad_dtype, alias_masters=False, copy_grads=copy_grads)
        self.delayed = delayed  # DPU (delay_update): gradients on disk alternate between two files
        self.swap_dir, self.threads, self.request_mb, self.piece = swap_dir, threads, request_mb, piece
        self.params = params  # parameter offload to nvme: where the shards that are not in memory are
        self.grads_on_disk = (
            grads_on_disk  # grad_device and host_budget (host_budget.disk_split): its own swap file
        )
        self.resident = resident  # the host budget's pieces of the states, held in RAM (host_budget.py)

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


class ResidentStates:
    """Master, exp_avg and exp_avg_sq of every unit held in memory (device or host tier)."""

    def __init__(self, masters: list[torch.Tensor], zeros):
        self.masters = masters
        self.exp_avg = [zeros(m) for m in masters]
        self.exp_avg_sq = [zeros(m) for m in masters]

    def spans(self, i: int) -> list[tuple[int, int, int]]:
        """Unit i is one piece, resident whole."""
        return [(i, 0, self.masters[i].numel())]

    @contextlib.contextmanager
    def open(self, i: int, following: int | None = None, write_back: bool = True):
        yield self.masters[i], self.exp_avg[i], self.exp_avg_sq[i]

    def read(self, i: int, kind: str) -> torch.Tensor:
        return (self.masters, self.exp_avg, self.exp_avg_sq)[KINDS.index(kind)][i]

    def write(self, i: int, kind: str, src: torch.Tensor) -> None:
        self.read(i, kind).copy_(src)

    def resident_bytes(self, shards: list[torch.Tensor]) -> int:
        masters = [m for m, s in zip(self.masters, shards) if m is not s]  # fp32 steps the shard in place
        return sum(t.numel() * t.element_size() for t in masters + self.exp_avg + self.exp_avg_sq)

    def disk_bytes(self) -> int:
        return 0

    def save_file(self, path: Path) -> None:
        """Not a file: the checkpoint streams these units (state_swap.SwappedStates copies its file)."""
        return None

    def load_file(self, path: Path) -> None:
        return None

    def close(self) -> None:
        pass
