"""The disk tier's gradient shard in a swap file of its own (ZeRO-Infinity swaps gradients): each landing is a
write (a read-modify-write while accumulating), the step reads unit after unit with the next read ahead. RAM:
GRAD_BUFFERS unit-sized buffers, whatever the partition's size. Cost: 2 B/param/N (4 while accumulating)
written per micro-batch and read per step beside the optimizer's own traffic. The store's interface and the
in-memory shards are step/grad_store.py's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from zoff.engine.disk.swapfile import ALIGN, AlignedBuffer, SwapFile, aligned
from zoff.engine.staging import Staging
from zoff.engine.step.grad_store import GradShards

GRAD_BUFFERS = 3  # the unit being landed or stepped, the next one read ahead, one write in flight


class DiskGrads(GradShards):
    """Every unit's gradient shard in one 4096-aligned region of a swap file, in `dtype`."""

    resident = False

    def __init__(
        self, numels: list[int], dtype: torch.dtype, swap_dir: Path, *, threads: int, request_bytes: int,
        staging: Staging | None = None, name: str = "grads.swap",
    ):  # fmt: skip
        super().__init__(len(numels))
        self.numels, self.dtype, self.staging = numels, dtype, staging
        self.offset, end = [], 0
        for n in numels:
            self.offset.append(end)
            end += aligned(n * dtype.itemsize)
        rank = os.environ.get("RANK", "0")
        self.file = SwapFile(swap_dir / f"rank{rank}" / name, max(end, ALIGN), threads, request_bytes)
        largest = max((n * dtype.itemsize for n in numels), default=1)
        self.buffers = [AlignedBuffer(largest) for _ in range(GRAD_BUFFERS)]
        self.pending: list[list[Future]] = [[] for _ in self.buffers]  # I/O in flight on each buffer
        self.holds: dict[int, int] = {}  # unit -> the buffer its read went into (the step's read-ahead)
        self.writing: dict[int, int] = {}  # unit -> the buffer whose write of it may be in flight
        self._next = 0

    def _view(self, b: int, u: int) -> torch.Tensor:
        return self.buffers[b].view(self.dtype, 0, self.numels[u])

    def _free(self, keep: tuple[int, ...] = ()) -> int:
        """The next buffer in turn that no held read is in, once its I/O has finished."""
        for _ in range(len(self.buffers)):
            b, self._next = self._next, (self._next + 1) % len(self.buffers)
            if b not in keep and b not in self.holds.values():
                self.file.wait(self.pending[b])
                self.pending[b] = []
                return b
        raise RuntimeError("zoff: no free gradient swap buffer (a bug: more reads held than buffers)")

    def _read(self, u: int, keep: tuple[int, ...] = ()) -> int:
        if u not in self.holds:
            self._drain_writes()  # a read of a unit whose write is in flight must see that write
            b = self._free(keep)
            self.pending[b] = self.file.read(self.buffers[b].bytes[: self._nbytes(u)], self.offset[u])
            self.holds[u] = b
        return self.holds[u]

    def _nbytes(self, u: int) -> int:
        return aligned(self.numels[u] * self.dtype.itemsize)

    def _wait(self, b: int) -> None:
        self.file.wait(self.pending[b], reads=True)
        self.pending[b] = []

    def _drain_writes(self) -> None:
        for b in range(len(self.buffers)):
            if b not in self.holds.values():
                self.file.wait(self.pending[b])
                self.pending[b] = []

    def _write(self, b: int, u: int) -> None:
        older = self.writing.get(u)
        if older is not None and older != b:  # a write of u still in flight must not land after this one
            self.file.wait(self.pending[older])
            self.pending[older] = []
        self.writing[u] = b
        tail = self.numels[u] * self.dtype.itemsize
        region = self.buffers[b].bytes[: self._nbytes(u)]
        region[tail:].zero_()  # the page's rest is padding: zeros, so the file is reproducible
        self.pending[b] = self.file.write(region, self.offset[u])

    def land(self, u: int, src: torch.Tensor | None, *, copy: bool, divide: int, final: bool) -> None:
        if copy:
            self.holds.clear()  # a new window: any read-ahead of the last step is stale
            b = self._free()
        else:  # read-modify-write: the micro-batches accumulate on disk
            b = self._read(u)
            self._wait(b)
            del self.holds[u]
        self._accumulate(u, self._view(b, u), src, copy, divide, final)
        self._write(b, u)
        if final:
            self._final(u, self.pending[b])

    def correct(self, u: int, delta: torch.Tensor, alpha: float, final: bool) -> None:
        b = self._read(u)
        self._wait(b)
        del self.holds[u]
        out = self._view(b, u)
        out.add_(delta.to("cpu"), alpha=alpha)
        if final:
            self._fold(u, out)
        self._write(b, u)
        if final:
            self._final(u, self.pending[b])

    def final_view(self, u: int, writes: list, buffer: AlignedBuffer) -> torch.Tensor:
        """Unit u's final gradient read into the speculation's own `buffer`, once its landing's `writes` are
        on disk (nothing of the store's buffers or read-ahead is touched: backward lands beside it)."""
        self.file.wait(writes)
        self.file.wait(self.file.read(buffer.bytes[: self._nbytes(u)], self.offset[u]), reads=True)
        return buffer.view(self.dtype, 0, self.numels[u])

    def get(self, u: int) -> torch.Tensor:
        """Unit u's shard, read (the step walks units in order: unit u+1 is read meanwhile). The view is
        valid until get(u + 2)."""
        for held in [k for k in self.holds if k < u]:
            del self.holds[held]  # the step is past it
        b = self._read(u)
        if u + 1 < len(self.numels):
            self._read(u + 1, keep=(b,))
        self._wait(b)
        return self._view(b, u)

    def norms_sq(self) -> list[float]:
        out = super().norms_sq()
        self.holds.clear()
        return out

    @property
    def files(self) -> list[SwapFile]:
        return [self.file]

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def disk_bytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        self.holds.clear()
        try:
            self._drain_writes()  # (a write-back's I/O error is raised; the file is closed and removed all the same)
        finally:
            self.file.close()


class DelayedDiskGrads(GradShards):
    """The disk tier's gradient shard under DPU (zero.offload_optimizer.delay_update): two swap files, one the
    backward lands in and one the delayed step reads while the next backward runs, swapped at each delayed
    step (for_step). Each is a DiskGrads with its own buffers and I/O threads, so the two threads never share
    a buffer. Cost: a second gradient file on disk (2 B/param/N, 4 while accumulating) and its three buffers
    in RAM, instead of DPU's snapshot of the whole shard in RAM (4 B/param/N when clipping rescales it)."""

    resident = False

    def __init__(self, make: Callable[[str], DiskGrads]):
        self.live, self.stepped = make("grads.swap"), make("grads.1.swap")
        self.numels, self.dtype, self.staging = self.live.numels, self.live.dtype, self.live.staging

    def for_step(self, delayed: bool) -> GradShards:
        if not delayed:  # (DPU's warm-up steps run before the next backward: no swap)
            return self.live
        self.live, self.stepped = self.stepped, self.live
        return self.stepped

    def land(self, u: int, src: torch.Tensor | None, *, copy: bool, divide: int, final: bool) -> None:
        self.live.land(u, src, copy=copy, divide=divide, final=final)

    def correct(self, u: int, delta: torch.Tensor, alpha: float, final: bool) -> None:
        self.live.correct(u, delta, alpha, final)

    def get(self, u: int) -> torch.Tensor:
        return self.live.get(u)

    def begin_window(self) -> None:
        self.live.begin_window()

    def norms_sq(self) -> list[float]:
        return self.live.norms_sq()

    @property
    def files(self) -> list[SwapFile]:
        return [self.live.file, self.stepped.file]

    def host_bytes(self) -> int:
        return self.live.host_bytes() + self.stepped.host_bytes()

    def disk_bytes(self) -> int:
        return self.live.disk_bytes() + self.stepped.disk_bytes()

    def close(self) -> None:
        try:
            self.live.close()
        finally:
            self.stepped.close()
