"""Bounded staging between device and host memory: the offload optimizer's gradient downloads and parameter
uploads go through a few fixed page-locked buffers instead of pinning whole shards.

Pinning the fp32 master and both moments (12 B/param/N) is what a host refuses first: page-locked memory
cannot be swapped, and a 70B model at N=8 would lock ~105 GB per rank. Here only `buffer_bytes` are pinned
(two halves, so one chunk's DMA overlaps the host copy of the other); the optimizer states stay pageable.
Cost: one host-side copy per chunk (pinned <-> pageable, and the dtype conversion, at memory bandwidth).

Downloads land on one worker thread (landing.py) where the engine overlaps its reductions: the thread
that runs backward only marks the compute stream (ready) and goes on. Uploads run on a side stream: the
host goes on to the next unit's CPU Adam while the previous unit's parameters cross the bus;
`uploads_done()` orders the compute stream after them (no host wait), or a reader waits for its own
unit's (`mark()`, `wait_for()`: the overlapped step's forward). A host-only machine has nothing to
stage and never builds one; the tests run the same chunking through unpinned host buffers with null streams
(`Staging(..., device=cpu)`), so no arithmetic here is CUDA-only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


def needs_staging(device: torch.device) -> bool:
    """Offload stages its copies where the device is not the host (a CPU-only machine aliases instead)."""
    return device.type != "cpu"


def chunk_bytes(buffer_bytes: int) -> int:
    """Each of the two buffers: half the budget, at least a page, a multiple of every element size."""
    return max(1 << 12, buffer_bytes // 2) // 16 * 16


class NullEvent:
    """A host-only stand-in for torch.cuda.Event: every copy is already complete when issued."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Staging:
    """Two pinned chunk buffers of buffer_bytes / 2; download (device -> host) and upload (host -> device)."""

    def __init__(self, buffer_bytes: int, device: torch.device, pin: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunk_bytes = chunk_bytes(buffer_bytes)
        pin = pin and self.cuda
        self.buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.pinned = pin
        self.events = [torch.cuda.Event() if self.cuda else NullEvent() for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._next = 0
        self.chunks = 0  # chunk copies issued, both directions (tests check the bound is honoured)
        self._local = threading.local()  # a landing thread's `ordered_after` event

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers) if self.pinned else 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _take(self, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, object]:
        """The next buffer as `n` elements of `dtype`, once the DMA last issued from or into it has finished."""
        i, self._next = self._next, 1 - self._next
        self.events[i].synchronize()
        self.chunks += 1
        return self.buffers[i].view(dtype)[:n], self.events[i]

    def _spans(self, t: torch.Tensor, elem_bytes: int) -> list[tuple[int, int]]:
        step = self.chunk_bytes // elem_bytes
        return [(a, min(a + step, t.numel())) for a in range(0, t.numel(), step)]

    def ready(self) -> object | None:
        """(On the thread that finished the reduction) an event after what the compute stream has queued so far,
        for a download run later on another thread (landing.py): ordered after it, not after whatever that
        stream holds when the download starts (kernels queued since the reduction finished and before this
        call are included: a later start, never a wrong one). None on a host-only machine."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def ordered_after(self, event: object | None) -> Iterator[None]:
        """Downloads in this block (on this thread) start once `event` (ready()) has passed on the device."""
        self._local.after = event
        try:
            with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
                yield
        finally:
            self._local.after = None

    def download(self, src: torch.Tensor, dst: torch.Tensor, add: bool = False) -> None:
        """dst (host, any float dtype) <- src (device), or dst += src with `add` (a gradient accumulating
        in its host tier: the same arithmetic as adding on the device); returns with dst complete.

        Chunk k+1's DMA is in flight while the host copies chunk k out of the other buffer."""
        src, dst = src.reshape(-1), dst.reshape(-1)
        if self.cuda:  # the side stream reads what the compute stream wrote (the reduced gradients)
            after = getattr(self._local, "after", None)
            if after is not None:
                self.stream.wait_event(after)
            else:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
        pending: list[tuple[torch.Tensor, object, int, int]] = []
        for a, b in self._spans(src, src.element_size()):
            buf, event = self._take(src.dtype, b - a)
            with self._on_side():
                buf.copy_(src[a:b], non_blocking=True)
                event.record(self.stream)
            pending.append((buf, event, a, b))
            if len(pending) == 2:
                self._drain(pending.pop(0), dst, add)
        for item in pending:
            self._drain(item, dst, add)

    @staticmethod
    def _drain(item: tuple[torch.Tensor, object, int, int], dst: torch.Tensor, add: bool) -> None:
        buf, event, a, b = item
        event.synchronize()
        dst[a:b].add_(buf) if add else dst[a:b].copy_(buf)

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst (device) <- src (host), converted to dst's dtype on the host; returns before the DMA lands."""
        src, dst = src.reshape(-1), dst.reshape(-1)
        for a, b in self._spans(dst, dst.element_size()):
            buf, event = self._take(dst.dtype, b - a)
            buf.copy_(src[a:b])
            with self._on_side():
                dst[a:b].copy_(buf, non_blocking=True)
                event.record(self.stream)

    def mark(self) -> object | None:
        """An event after every upload issued so far (on the side stream), for one reader to wait for
        (wait_for) instead of every later upload; None on a host-only machine."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_for(self, mark: object | None) -> None:
        """This thread's compute stream waits (on the GPU; the host goes on) for the uploads before `mark`."""
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    def uploads_done(self) -> None:
        """Order the compute stream after every upload issued so far (a GPU-side wait; the host goes on)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
