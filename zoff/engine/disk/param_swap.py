"""Stage 3's parameter shards on local disk (ZeRO-Infinity's parameter NVMe offload).

Every non-persistent unit's shard (frozen ones too) has one 4096-aligned region of a swap file, in the compute
dtype. A gather reads the shard into a page-aligned buffer just in time (the gatherer's prefetch window
bounds how many are in flight) and all-gathers from it; the buffer is released with the read. After the
optimizer step each updated piece of a master is written back, converted to the compute dtype on the way; a
parameter shard is written only when it changed, and never read by the step (the optimizer's master is on
its own swap file). RAM: the shards being gathered, not the partition.

The overlapped step (overlap.py) keeps what its walk writes back of the last HELD_UNITS units: the next
forward trails the walk by about a block, so it gathers a unit moments after its write-back, and reads it from
these buffers instead of the disk. That takes the forward's parameter reads (one of the three passes over the
parameter file a step makes) off the disk while the walk is using it; RAM: up to HELD_UNITS + 1 shards more
(the next ones held while a gather copies one out), as traffic.held_write_back_bytes counts them.

Released buffers are kept (a few per size) for the next read or write of that size, until trim(): a fresh
anonymous map costs a page fault and a page of zeroing per 4 KiB on first touch, and an unmap to free it,
which for the 3.4B demo was ~20 GB a step (every block read twice and written once), on the cores the
forward and the CPU Adam need. The engine trims when a step starts and ends, so what a phase keeps never
outlives it: the reads' buffers are not held through the optimizer step, nor the writes' through backward.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from zoff.config import ZeroConfig
from zoff.engine.disk.placement import param_swap_path
from zoff.engine.disk.swapfile import ALIGN, AlignedBuffer, SwapFile, aligned
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy

# Write-backs in flight during the step: each holds one piece's 16-bit copy; more would only add RAM (the
# disk serves them in order anyway) and fewer would make the step wait for each write.
MAX_WRITES = 2
SPARES = 4  # released buffers kept per size: the gatherer's reads in flight, a block and the next
HELD_UNITS = 2  # the overlapped step: the unit the forward waits for and the one the walk is writing


class ShardRead:
    """A shard being read from the swap file; wait() returns it (a view of its own aligned buffer)."""

    def __init__(
        self, owner: SwappedShards, buf: AlignedBuffer, futures: list[Future], numel: int, dtype: torch.dtype
    ):
        self.owner, self.file, self.buf, self.futures = owner, owner.file, buf, futures
        self.numel, self.dtype = numel, dtype

    def wait(self) -> torch.Tensor:
        self.file.wait(self.futures, reads=True)  # a gather waiting for its shard: the forward's disk wait
        self.futures = []
        return self.buf.view(self.dtype, 0, self.numel)

    def release(self) -> None:
        """The shard has been used (its all-gather is done): its buffer may take the next read."""
        if not self.futures and self.buf is not None:
            self.owner.give(self.buf)
        self.buf = None


class SwappedShards:
    """The parameter shards of the units in `numels` (unit index -> shard elements), in one swap file."""

    def __init__(
        self, numels: dict[int, int], dtype: torch.dtype, swap_dir: Path, *, threads: int, request_bytes: int,
        hold_units: int = 0, slotted: frozenset[int] = frozenset(), name: str = "params.swap",
        lazy_slots: bool = False,
    ):  # fmt: skip
        self.numels, self.dtype = dict(numels), dtype
        self.offset: dict[int, int] = {}
        end = 0
        for u, n in self.numels.items():
            self.offset[u] = end
            end += aligned(n * dtype.itemsize)
        # DPU (delay_update): the `slotted` units (the trainable ones) have a second region, which the delayed
        # step writes while the next forward and backward read the first; flip() swaps them. Frozen units
        # never change: one region, read in either slot. Cost: the trainable shards twice on disk.
        self.slots = [dict(self.offset), dict(self.offset)]
        first = end  # (speculation's second regions, `lazy_slots`, are claimed by allocate_second)
        for u in sorted(u for u in slotted if u in self.numels):
            self.slots[1][u] = end
            end += aligned(self.numels[u] * dtype.itemsize)
        self.full_bytes = max(end, ALIGN)
        self.slot = 0  # the region gathers read and foreground writes write
        # speculation: units whose live region is the other one (a committed speculative shard lies there)
        self.flipped: set[int] = set()
        rank = os.environ.get("RANK", "0")
        self.file = SwapFile(
            swap_dir / f"rank{rank}" / name, max(first if lazy_slots else end, ALIGN), threads, request_bytes
        )
        # (buffer, I/O, whether it writes a region gathers read): a gather waits for those alone, not for the
        # delayed step's or speculation's writes into the other regions. Recorded at the write, as the live
        # regions are then: flip() and flip_units() flush every write before they change which is live.
        self.writes: deque[tuple[AlignedBuffer, list[Future], bool]] = deque()
        # the overlapped step writes back from its walk thread while gathers read here: one queue, locked
        self._lock = threading.Lock()
        self._spare: dict[int, list[AlignedBuffer]] = {}  # nbytes -> released buffers (module docstring)
        # the overlapped step's written-back pieces, per unit in write order: (element lo, elements, buffer)
        self.hold_units = hold_units
        self.held: dict[int, list[tuple[int, int, AlignedBuffer]]] = {}
        self._held_bufs: set[AlignedBuffer] = set()  # buffers in `held`: not spares when their write lands
        self._landed_bufs: set[AlignedBuffer] = set()  # held buffers whose write has landed
        # (sets of the buffers themselves, hashed by identity: they stay alive while listed, so no entry can
        # ever match a later buffer, as a freed object's id() could)
        self.read_from_memory_bytes = 0  # shard bytes a gather took from `held` rather than the disk
        # units whose shard is cast from a master in RAM (traffic.master_served_units): unit -> fill(out)
        self.from_master: dict[int, Callable[[torch.Tensor], None]] = {}
        self.cast_bytes = 0  # shard bytes gathers cast from resident masters

    def _take(self, nbytes: int) -> AlignedBuffer:
        with self._lock:
            spare = self._spare.get(aligned(max(nbytes, 1)))
            if spare:
                return spare.pop()
        return AlignedBuffer(nbytes)

    def give(self, buf: AlignedBuffer) -> None:
        """A buffer no read uses any longer."""
        with self._lock:
            self._keep(buf)

    def _keep(self, buf: AlignedBuffer) -> None:
        """(Under the lock.) A buffer nothing uses: a spare, if there is room."""
        spare = self._spare.setdefault(buf.nbytes, [])
        if len(spare) < SPARES:
            spare.append(buf)

    def _landed(self, buf: AlignedBuffer) -> None:
        """(Under the lock.) A write-back's write landed: its buffer is free unless a unit holds it. Decided
        under the lock, with _unhold, so that a buffer never enters the spares twice."""
        if buf in self._held_bufs:
            self._landed_bufs.add(buf)
        else:
            self._keep(buf)

    def trim(self) -> None:
        """Free the kept buffers (the engine, as a step starts and ends), the held write-backs too."""
        self.drop_held()
        with self._lock:
            self._spare.clear()

    def drop_held(self) -> None:
        """No gather will take the held write-backs (backward begins): back to the spares."""
        with self._lock:
            for u in list(self.held):
                self._unhold(self.held.pop(u))

    def _unhold(self, pieces: list[tuple[int, int, AlignedBuffer]]) -> None:
        """(Under the lock.) Held buffers no read will take: back to the spares once their writes landed."""
        for _, _, buf in pieces:
            self._held_bufs.discard(buf)
            if buf in self._landed_bufs:
                self._landed_bufs.discard(buf)
                self._keep(buf)

    def _held_read(self, u: int) -> ShardRead | None:
        """Unit u's shard from the pieces the walk wrote back, if they cover it (else None: read the disk)."""
        with self._lock:
            pieces = self.held.pop(u, None)
        if pieces is None:
            return None
        n, end = self.numels[u], 0
        for lo, count, _ in sorted(pieces, key=lambda p: p[0]):
            if lo > end:
                break
            end = max(end, lo + count)
        read = None
        try:
            if end >= n:  # whole: copied in write order, so a piece written twice reads as its last write
                buf = self._take(n * self.dtype.itemsize)
                out = buf.view(self.dtype, 0, n)
                for lo, count, src in pieces:
                    out[lo : lo + count].copy_(src.view(self.dtype, 0, count))
                self.read_from_memory_bytes += n * self.dtype.itemsize
                read = ShardRead(self, buf, [], n, self.dtype)
        finally:  # (even on an error: a buffer left in _held_bufs would never be a spare)
            with self._lock:
                self._unhold(pieces)
        return read

    def holds(self, u: int) -> bool:
        return u in self.offset

    def read(self, u: int) -> ShardRead:
        """Start reading unit u's shard (wait() on the result). Any write of it still in flight lands first."""
        fill = self.from_master.get(u)
        if fill is not None:
            n = self.numels[u]
            buf = self._take(n * self.dtype.itemsize)
            fill(buf.view(self.dtype, 0, n))
            self.cast_bytes += n * self.dtype.itemsize
            return ShardRead(self, buf, [], n, self.dtype)
        held = self._held_read(u) if self.held else None
        if held is not None:
            return held
        self.flush(live_only=True)  # (not the delayed step's writes: they go to the other slot)
        n = self.numels[u]
        buf = self._take(n * self.dtype.itemsize)  # the read fills it whole: the region's padding is zeros
        return ShardRead(self, buf, self.file.read(buf.bytes, self.slots[self.live(u)][u]), n, self.dtype)

    def live(self, u: int) -> int:
        """The slot of unit u's region that gathers read."""
        return self.slot ^ (u in self.flipped)

    def write_second(self, u: int, lo: int, src: torch.Tensor) -> None:
        """A speculative piece of unit u's new shard into the region gathers do not read (backward's gathers
        of other units go on meanwhile); flip_units makes it the live one. Never held for a gather."""
        self.write(u, lo, src, slot=self.live(u) ^ 1, hold=False)

    def allocate_second(self) -> None:
        """Claim the second regions' space (the first speculated step; OSError naming the file when the disk
        has not the room)."""
        self.file.grow(self.full_bytes)

    def flip_units(self, units) -> None:
        """Committed speculative shards become the live ones (their writes landed first)."""
        self.flush()
        self.flipped ^= set(units)

    def load(self, u: int) -> torch.Tensor:
        return self.read(u).wait()

    def write(self, u: int, lo: int, src: torch.Tensor, slot: int | None = None, hold: bool = True) -> None:
        """Unit u's elements [lo, lo + len(src)) from `src` (any float dtype), asynchronously, into `slot`
        (None: the one gathers read; the delayed step writes the other).

        A write must start on a page: lo is 0 or a multiple of the optimizer's sub-group (whole 4096-element
        pages)."""
        if u in self.from_master:
            return  # its gathers cast the master itself: nothing on disk is read
        slot = self.live(u) if slot is None else slot
        n, size = src.numel(), self.dtype.itemsize
        start = self.slots[slot][u] + lo * size
        if start % ALIGN or (lo + n < self.numels[u] and (n * size) % ALIGN):
            raise ValueError(f"parameter swap write of unit {u} at element {lo} (+{n}) is not page-aligned")
        buf = self._take(n * size)
        buf.bytes[n * size :].zero_()  # its tail lands in the region's own padding: zeros, as in a fresh map
        buf.view(self.dtype, 0, n).copy_(src.reshape(-1))
        with self._lock:
            self.writes.append((buf, self.file.write(buf.bytes, start), slot == self.live(u)))
            if self.hold_units and hold:
                if u not in self.held and len(self.held) >= self.hold_units:
                    oldest = next(iter(self.held))  # not read by now: its gather reads the disk
                    self._unhold(self.held.pop(oldest))
                self.held.setdefault(u, []).append((lo, n, buf))
                self._held_bufs.add(buf)
            excess = [
                f for _, futures, _ in list(self.writes)[: len(self.writes) - MAX_WRITES] for f in futures
            ]
        self._wait_and_settle(excess)

    def flush(self, live_only: bool = False) -> None:
        """Wait for every write-back, or (before a read, and at the end of a step) those into the regions
        gathers read: a unit's live region is slot 1 where speculation flipped it, whatever `self.slot` is
        (the harness's seeds 1148, 1345 and 1430 read such a unit before its walk's write-back landed)."""
        with self._lock:
            pending = [f for _, futures, live in self.writes if live or not live_only for f in futures]
        self._wait_and_settle(pending)

    def _wait_and_settle(self, futures: list[Future]) -> None:
        """Wait for `futures` with the lock released (a gather's read must not queue behind another thread's
        write: DPU's step writes beside the whole forward and backward), then land every finished write. A
        write stays listed until it has landed, so a read's flush still sees one another thread waits on."""
        if not futures:
            return
        self.file.wait(futures)
        with self._lock:
            still = deque()
            for entry in self.writes:
                if all(f.done() for f in entry[1]):
                    self._landed(entry[0])
                else:
                    still.append(entry)
            self.writes = still

    def flip(self) -> None:
        """The delayed step's slot becomes the one gathers read (after that step has finished: every
        trainable unit's new shard is written there), and the old one the next delayed step's."""
        self.flush()
        self.slot ^= 1

    def disk_bytes(self) -> int:
        return self.full_bytes  # (speculation's second regions too, claimed or still to be: they are planned)

    def close(self) -> None:
        try:
            self.flush()  # (a write-back's I/O error is raised; the file is closed and removed all the same)
        finally:
            self.file.close()


def param_file(
    zero: ZeroConfig,
    policy: Policy,
    plan: PartitionPlan,
    dtype: torch.dtype,
    second: frozenset[int] = frozenset(),
) -> SwappedShards | None:
    """Parameter offload to nvme: every non-persistent unit's shard (frozen ones too) in a swap file; under DPU
    the trainable shards in two slots, under speculation the `second` units' (second_slots). None without it."""
    if not policy.params_on_disk:
        return None
    op, oo = zero.offload_param, zero.offload_optimizer
    numels = {u.index: u.shard for u in plan.all_units if not u.persistent}
    return SwappedShards(
        numels, dtype, Path(param_swap_path(zero)), threads=op.io.threads, request_bytes=op.io.request_mb << 20,
        hold_units=HELD_UNITS if oo.overlap_step else 0,
        slotted=frozenset(u.index for u in plan.units if not u.persistent) if oo.delay_update else second,
        lazy_slots=not oo.delay_update,
    )  # fmt: skip


def next_params_file(
    zero: ZeroConfig, policy: Policy, plan: PartitionPlan, dtype: torch.dtype
) -> SwappedShards | None:
    """DPU on the disk tier with the parameters in memory: the delayed step writes the new 16-bit shards to
    a file of their own (the live shards are what the next forward reads), which flush() reads back: 2
    B/param each way rather than every streamed state read back (12 B/param of them). None otherwise."""
    oo = zero.offload_optimizer
    if not (oo.delay_update and policy.offload_optimizer == "nvme" and not policy.params_on_disk):
        return None
    return SwappedShards(
        {u.index: u.shard for u in plan.units}, dtype, Path(oo.nvme_path), threads=oo.io.threads,
        request_bytes=oo.io.request_mb << 20, name="params.next.swap",
    )  # fmt: skip
