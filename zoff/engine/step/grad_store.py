"""Where a rank's reduced gradient partition lives: with the optimizer's states, in the tier that holds them.

Each unit's gradient shard is an accumulator that the reducer (reduce.py) lands every finished reduction in:
copied on the window's first micro-batch, added on the others (in fp32 when micro-batches accumulate), divided
by the world size on the last one, and, on that last landing, its squared norm and finiteness are folded in
while the shard is hot, so the step needs no second pass over it.

- ResidentGrads: the shards in memory. On the device without offload (stages 0-1 keep them as views of the
  full gradient buffers); in host memory under optimizer offload (ZeRO-Offload, FSDP2's CPUOffloadPolicy,
  DeepSpeed's fp32 host gradient partition). Where the host is not the device, a reduction finishes into a
  pooled device buffer and lands through the bounded pinned staging (staging.py: a side stream, events
  before the host reads); on a host-only machine the reduction writes the host shard in place, so every
  result is the same bit for bit whichever tier holds it.
- DiskGrads (disk/grad_swap.py): the disk tier's shards in a swap file of their own (ZeRO-Infinity swaps gradients): each landing
  is a write (a read-modify-write while accumulating), the step reads unit after unit with the next read
  ahead. RAM: three unit-sized buffers, whatever the partition's size. Cost: 2 B/param/N (4 while
  accumulating) written per micro-batch and read per step beside the optimizer's own traffic.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from zoff.engine.staging import Staging

NORM_CHUNK = 1 << 18  # elements per chunk of a host norm: 2 MiB of fp64, cache-resident
_scratch = threading.local()


def unit_norm(g: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a gradient shard, in fp64 on the host (a 0-dim tensor where g lies).

    On the host, chunk by chunk through a small fp64 buffer: torch's CPU vector_norm(g, dtype=float32) first
    converts a 16-bit shard to a whole fp32 copy (a fresh 4 B/param tensor: 0.15 s for a 113M-parameter
    block of the 3.4B demo, against 0.03 s here), and its fp32 accumulator loses small squares once the sum
    is large: 1.1% off on that block (randn * 3 in bf16), where fp64 is exact to ~1e-12. The clipping
    coefficient is computed from it, so that error was an error in every clipped update. On a GPU the
    reduction is a tree in fp32 (accurate, and no host sync here)."""
    if g.device.type != "cpu":
        return torch.linalg.vector_norm(g, dtype=torch.float32)
    flat = g.reshape(-1)
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = torch.empty(NORM_CHUNK, dtype=torch.float64)
    total = 0.0
    for a in range(0, flat.numel(), NORM_CHUNK):
        part = buf[: min(NORM_CHUNK, flat.numel() - a)]
        part.copy_(flat[a : a + NORM_CHUNK])
        total += float(torch.dot(part, part))  # squares and sum in fp64: no overflow, no lost small terms
    return torch.tensor(math.sqrt(total), dtype=torch.float64)


class GradShards:
    """What the reducer and the step ask of a gradient store; the subclasses say where the shards live."""

    resident = True  # the shards are tensors the step can read where they lie
    staging: Staging | None = None  # where the host is not the device: reductions come down through it
    # speculation (speculate.py): told (u, the I/O still writing it) when unit u's gradient of the window is
    # final, and again if a late correction changes it afterwards
    on_final: Callable[[int, list], None] | None = None

    def __init__(self, n: int):
        self._norms: list[torch.Tensor | None] = [None] * n

    def target(self, u: int) -> torch.Tensor | None:
        """Unit u's accumulator when a reduction may write straight into it (it lies on the compute device)."""
        return None

    def land(self, u: int, src: torch.Tensor | None, *, copy: bool, divide: int, final: bool) -> None:
        """A finished reduction of unit u: `src` copied (`copy`) or added into the accumulator (None: it was
        reduced into target(u) already), then divided by `divide` (> 1 on the window's last micro-batch);
        `final`: the window's last landing, so the unit's norm is folded in now."""
        raise NotImplementedError

    def correct(self, u: int, delta: torch.Tensor, alpha: float, final: bool) -> None:
        """Add a late gradient's reduction (reduce.py's correction) times alpha into unit u's accumulator."""
        raise NotImplementedError

    def get(self, u: int) -> torch.Tensor:
        """Unit u's shard for the step (resident: the accumulator itself)."""
        raise NotImplementedError

    def final_view(self, u: int, writes: list, buffer) -> torch.Tensor:
        """Unit u's final gradient for a speculative update, on the speculation's thread while backward goes
        on: resident, the accumulator itself; on disk (grad_swap), read into `buffer` once `writes` landed."""
        return self.get(u)

    def _final(self, u: int, writes: list = ()) -> None:
        if self.on_final is not None:
            self.on_final(u, list(writes))

    def begin_window(self) -> None:
        """A new accumulation window: the folded norms belong to the last one."""
        self._norms = [None] * len(self._norms)

    def for_step(self, delayed: bool) -> GradShards:
        """The store the optimizer step reads: this one, unless the step runs `delayed` (DPU) while the next
        backward lands here (DelayedDiskGrads hands over its landed slot and lands in the other)."""
        return self

    def norms_sq(self) -> list[float]:
        """Each unit's squared norm, as folded at its last landing; 0 where nothing landed in this window (a
        step with no backward since zero_grad: no gradient, as torch's optimizers see grad None; the shard
        still holds an earlier window's, two windows back under DPU on disk, which were once summed here
        and made a wrong grad_norm, and under fp16 a stale overflow). inf or nan where the shard is not
        finite."""
        return [0.0 if norm is None else float(norm) ** 2 for norm in self._norms]

    def _fold(self, u: int, g: torch.Tensor) -> None:
        self._norms[u] = unit_norm(g)

    def _accumulate(
        self, u: int, out: torch.Tensor, src: torch.Tensor | None, copy: bool, divide: int, final: bool
    ) -> None:
        """land()'s arithmetic on the accumulator `out`, wherever it lies; the same ops in the same order as
        on the device, so every tier gives the same bits."""
        if src is not None:
            if self.staging is not None:  # device -> host; complete on return (events before the host reads)
                self.staging.download(src, out, add=not copy)
            else:
                out.copy_(src) if copy else out.add_(src)
        if divide > 1:
            # As the device divides: CUDA's division by a scalar multiplies by its reciprocal, and the host's
            # true division would differ from it in the last bit of many elements (at N = 3, 5, 6, 7, ...).
            cuda = self.staging is not None and self.staging.cuda
            out.mul_(1.0 / divide) if cuda else out.div_(divide)
        if final:
            self._fold(u, out)

    def host_bytes(self) -> int:
        return 0

    def device_bytes(self) -> int:
        return 0

    @property
    def files(self) -> list:
        """The swap files the shards live in (disk/grad_swap.py): none in memory."""
        return []

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class ResidentGrads(GradShards):
    """The shards as tensors: on the device (`on_device`), or in host memory with `staging` (or None where
    the host is the device) carrying reductions down."""

    def __init__(self, shards: list[torch.Tensor], *, on_device: bool, staging: Staging | None = None):
        super().__init__(len(shards))
        self.shards, self.on_device, self.staging = shards, on_device, staging

    def target(self, u: int) -> torch.Tensor | None:
        return self.shards[u] if self.staging is None else None

    def land(self, u: int, src: torch.Tensor | None, *, copy: bool, divide: int, final: bool) -> None:
        self._accumulate(u, self.shards[u], src, copy, divide, final)
        if final:
            self._final(u)

    def correct(self, u: int, delta: torch.Tensor, alpha: float, final: bool) -> None:
        out = self.shards[u]
        out.add_(delta.to(out.device), alpha=alpha)
        if final:
            self._fold(u, out)
            self._final(u)

    def get(self, u: int) -> torch.Tensor:
        return self.shards[u]

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shards)

    def device_bytes(self) -> int:
        return self._bytes() if self.on_device else 0

    def host_bytes(self) -> int:
        return 0 if self.on_device else self._bytes()
