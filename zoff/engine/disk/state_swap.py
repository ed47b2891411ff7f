"""The disk tier's optimizer states (ZeRO-Infinity's optimizer NVMe offload): one swap file per rank that is,
byte for byte, the rank's checkpoint shard.

The file is a safetensors file laid out by `partition_layout`: per unit, its fp32 master, exp_avg and
exp_avg_sq (`u<i>.master`, ...) as the checkpoint names them, each on a 4096-byte boundary (O_DIRECT's
alignment; zero pad tensors in the gaps). So a checkpoint save is a file-to-file copy of the swap file
(swapfile.copy_file: two chunk buffers, no page cache, the checksum computed on the way) and a resume into the
same partitioning copies the shard back; nothing is converted and no unit passes through the optimizer's
buffers. Another world size or stage reads the shard through the checkpoint's pieces as every tier does.

The step walks the file in pieces: a unit, or a sub-group of at most io.subgroup_mb of states of a larger one.
A piece is three reads (its master, exp_avg and exp_avg_sq ranges) into one page-aligned buffer; up to five
buffers rotate (ring_size): the piece being stepped, the next ones being read, the previous ones being written. Host
memory: ring_size x the largest streamed piece's states, plus the pieces the host budget keeps in RAM
(zero.offload_optimizer.host_budget, placement.disk_split), which the step never reads or writes.

Speculation (step/speculate.py): the `speculated` streamed pieces have a second slot in a file of their own
(optimizer.spec.swap, the pieces back to back); `where[k]` says which slot holds piece k's states. A
speculative update reads the piece from its slot and writes it to the other, and commit flips `where`; a
discarded one leaves the slot it read untouched. The ring buffer that held it keeps no claim to its bytes. A
checkpoint first moves every piece living in the second slot back to the first (save_file), so the swap file
is still, byte for byte, the checkpoint shard.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from zoff.engine.disk.placement import kind_offset, partition_layout, piece_ram_bytes, ring_size, walk_pieces
from zoff.engine.disk.swapfile import AlignedBuffer, SwapFile, aligned, copy_file
from zoff.engine.step.states import KINDS, States
from zoff.errors import disk_errors


class SwappedStates(States):
    """Every unit's states in one swap file laid out as its checkpoint shard, stepped piece by piece.

    The `resident` pieces (the host budget's, placement.disk_split: whole units spread over the walk) live
    in RAM for good: never read or written during a step, synced into the file only for a checkpoint. The
    others stream through the ring; a ring buffer keeps the bytes of the piece it last held, so a piece still
    there is not read again, and reads run ahead of the walk into idle buffers; prefetch() starts the next
    walk's first streamed pieces while backward computes.
    """

    def __init__(
        self, shards: list[torch.Tensor], swap_dir: Path, download, *, threads: int, request_bytes: int,
        piece: int | None = None, source=None, resident: tuple[int, ...] = (),
        speculated: frozenset[int] = frozenset(),
    ):  # fmt: skip
        source = source or shards.__getitem__  # unit i's live shard, for its initial master
        self.pieces = walk_pieces(
            [s.numel() for s in shards], piece
        )  # piece k: (unit, lo, hi), in walk order
        self._spans: list[list[tuple[int, int, int]]] = [[] for _ in shards]
        for k, (i, lo, hi) in enumerate(self.pieces):
            self._spans[i].append((k, lo, hi))
        self.numel = [hi - lo for _, lo, hi in self.pieces]
        self.part = [aligned(4 * n) for n in self.numel]  # bytes of one kind of piece k, in buffer and file
        self.layout = partition_layout([s.numel() for s in shards])
        # piece k's three ranges in the file: a piece starts on a page (sub-groups are whole pages), and the
        # aligned tail of a unit's last piece lies in the padding before the next tensor
        self.offsets = [
            [self.layout.offsets[f"u{i}.{kind}"] + 4 * lo for kind in KINDS] for i, lo, _ in self.pieces
        ]
        rank = os.environ.get("RANK", "0")
        self.file = SwapFile(
            swap_dir / f"rank{rank}" / "optimizer.swap", self.layout.nbytes, threads, request_bytes
        )
        self.resident = frozenset(k for k in resident if 0 <= k < len(self.pieces))
        self._second_slots(swap_dir / f"rank{rank}", speculated, threads, request_bytes)
        self.home: dict[int, int] = {}  # resident piece k's byte offset in `kept`
        end = 0
        for k in sorted(self.resident):
            self.home[k], end = end, end + piece_ram_bytes(self.part[k])
        self.kept = AlignedBuffer(end) if self.resident else None
        streamed = [p for k, p in enumerate(self.part) if k not in self.resident]
        self.n_buffers = ring_size(len(streamed)) if streamed else 0
        self.buffers = [AlignedBuffer(piece_ram_bytes(max(streamed))) for _ in range(self.n_buffers)]
        self.pending: list[list] = [[] for _ in self.buffers]  # futures of the I/O in flight on each buffer
        self.holds: dict[int, int] = {}  # piece -> the buffer it is read (or being read) into, for the walk
        self.contents: list[int | None] = [None] * self.n_buffers  # the piece whose bytes each buffer holds
        self.used = [0] * self.n_buffers  # when each buffer was last opened (least recently used first)
        self._clock = 0
        self._current: int | None = None  # the buffer of the piece open now: never taken for another
        head = AlignedBuffer(len(self.layout.header))
        head.bytes.copy_(torch.frombuffer(bytearray(self.layout.header), dtype=torch.uint8))
        self.file.wait(self.file.write(head.bytes, 0))
        for k, (i, lo, hi) in enumerate(self.pieces):  # initial master from the live shard, zero moments
            buf = None if k in self.resident else self._free_buffer(exclude=())
            master, m, v = self._views(buf, k)
            download(source(i)[lo:hi], master)
            m.zero_()
            v.zero_()
            if buf is not None:
                self._write(buf, k)
        self._drain()

    def spans(self, i: int) -> list[tuple[int, int, int]]:
        """Unit i's pieces as (piece, lo, hi), in order (the step asks per unit: looked up, not searched)."""
        return self._spans[i]

    def master_cast(self, i: int) -> Callable[[torch.Tensor], None]:
        """fill(out): unit i's fp32 master cast into `out` (its 16-bit shard), every piece of it resident (the
        host budget's); the write-back's cast, so the same bits. For gathers that skip the parameter file."""
        spans = self.spans(i)
        if not spans or any(k not in self.resident for k, _, _ in spans):
            raise RuntimeError(f"zoff: unit {i}'s master is not all in RAM")  # a bug in the caller's rule
        pieces = [(lo, self._views(None, k)[0]) for k, lo, _ in spans]  # fixed buffers: valid while we live

        def fill(out: torch.Tensor) -> None:
            for lo, master in pieces:
                out[lo : lo + master.numel()].copy_(master)

        return fill

    def _region(self, b: int | None, i: int) -> tuple[AlignedBuffer, int]:
        """Where piece i's states lie in RAM: (its buffer, byte offset); b None for a resident piece."""
        return (self.kept, self.home[i]) if b is None else (self.buffers[b], 0)

    def _views(self, b: int | None, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (buf, base), n, p = self._region(b, i), self.numel[i], self.part[i]
        return tuple(buf.view(torch.float32, base + kind_offset(p, k), n) for k in range(3))

    def _second_slots(self, folder: Path, speculated: frozenset[int], threads: int, request: int) -> None:
        """The speculated streamed pieces' second slots: back to back in a file of their own."""
        self.speculated = frozenset(
            k for k in speculated if 0 <= k < len(self.pieces) and k not in self.resident
        )
        self.where = [0] * len(self.pieces)  # the slot holding piece k's states: 0 this file, 1 the second
        self.second: dict[int, list[int]] = {}
        end = 0
        for k in sorted(self.speculated):
            self.second[k] = [end + kind * self.part[k] for kind in range(3)]
            end += 3 * self.part[k]
        # made at the first speculated step (allocate_second): a run that never speculates never claims it
        self.spec_file: SwapFile | None = None
        self._second_file = (folder / "optimizer.spec.swap", end, threads, request)

    def allocate_second(self) -> None:
        """Make the second slots' file (OSError naming it when the disk has not the room)."""
        path, end, threads, request = self._second_file
        if self.spec_file is None and end:
            self.spec_file = SwapFile(path, end, threads, request)

    def _ranges(self, b: int | None, i: int, slot: int | None = None) -> tuple[SwapFile, list]:
        """Piece i's file (in `slot`, default the one holding it) and three (buffer range, file offset) pairs
        in buffer b (None: its resident home)."""
        (buf, base), p = self._region(b, i), self.part[i]
        at = [base + kind_offset(p, k) for k in range(3)]
        slot = self.where[i] if slot is None else slot
        file, offsets = (self.file, self.offsets[i]) if slot == 0 else (self.spec_file, self.second[i])
        return file, [(buf.bytes[a : a + p], off) for a, off in zip(at, offsets, strict=True)]

    def _idle(self, b: int) -> bool:
        return all(f.done() for f in self.pending[b])

    def _free_buffer(self, exclude) -> int:
        """A ring buffer for a new piece, once its I/O is done: one no read-ahead holds before one that does
        (that read-ahead is dropped), an idle one before a busy one, then the least recently used."""
        held = set(self.holds.values())
        free = [b for b in range(self.n_buffers) if b not in exclude and b != self._current]
        b = min(free, key=lambda b: (b in held, not self._idle(b), self.used[b]))
        if b in held:
            del self.holds[next(k for k, h in self.holds.items() if h == b)]
        self.file.wait(self.pending[b])
        self.pending[b] = []
        self.contents[b] = None
        return b

    def _write(self, b: int, i: int) -> None:
        self.pending[b] = self._write_ranges(b, i)
        self.contents[b] = i

    def _write_ranges(self, b: int | None, i: int, slot: int | None = None) -> list:
        """Write piece i from buffer b (None: its resident home) into `slot` (default: its own); the futures."""
        tail, out = 4 * self.numel[i], []
        file, ranges = self._ranges(b, i, slot)
        for region, off in ranges:
            region[tail:].zero_()  # the page's rest is the file's padding: zeros, so files are reproducible
            out += file.write(region, off)
        return out

    def _read_into(self, b: int | None, i: int) -> list:
        """Start reading piece i into buffer b (None: its resident home); the futures."""
        file, ranges = self._ranges(b, i)
        futures = [f for region, off in ranges for f in file.read(region, off)]
        if b is not None:
            self.pending[b] = futures
            self.contents[b], self.holds[i] = i, b
        return futures

    def _fetch(self, i: int, exclude=()) -> int:
        """The buffer piece i is (being) read into: held already, still in a buffer, or read now."""
        if i in self.holds:
            return self.holds[i]
        held = set(self.holds.values())
        for b, c in enumerate(self.contents):
            if c == i and b not in held and b not in exclude:  # its bytes are still here: no read
                self.holds[i] = b
                return b
        b = self._free_buffer(exclude)
        self._read_into(b, i)
        return b

    def _read_ahead(self, i: int, current: int | None, wrap: bool = False) -> None:
        """Start reading the streamed pieces after i (`wrap`: past the last, the walk's first) into buffers
        with nothing in flight; never waits. The walk itself never wraps: each step reads every streamed
        piece once, between its backward and its end, so the bytes a step moves are the estimate's."""
        n, ahead = len(self.pieces), self.n_buffers - 1
        for d in range(1, n):
            if ahead <= 0 or (i + d >= n and not wrap):
                return
            j = (i + d) % n
            if j in self.resident:
                continue
            ahead -= 1
            if j != i and not self._claim(j, current):
                return

    def _claim(self, j: int, current: int | None) -> bool:
        """Streamed piece j held for a coming take without waiting: already held; adopted from the buffer that
        has its bytes (its write-back may still be in flight: a read from the file now could overtake that
        write and bring last step's states); else read into an idle buffer. False: no idle buffer."""
        if j in self.holds:
            return True
        held = set(self.holds.values())
        hit = [b for b, c in enumerate(self.contents) if c == j and b not in held and b != current]
        if hit:
            self.holds[j] = hit[0]
            return True
        idle = [b for b in range(self.n_buffers) if b != current and b not in held and self._idle(b)]
        if not idle:
            return False
        self._read_into(min(idle, key=lambda b: self.used[b]), j)
        return True

    def _drain(self) -> None:
        for b in range(self.n_buffers):
            self.file.wait(self.pending[b])
            self.pending[b] = []

    @contextlib.contextmanager
    def open(self, i: int, write_back: bool = True):
        """Piece i's states, resident while the block runs; written back after it (asynchronously) unless
        `write_back=False` (only read: the buffer keeps the bytes). The pieces after it in the walk's order
        (placement.walk_pieces) are read meanwhile."""
        if i in self.resident:  # in RAM for good: no I/O; the disk reads the next streamed pieces meanwhile
            self._read_ahead(i, None)
            yield self._views(None, i)
            return
        b = self._take(i)
        self._read_ahead(i, b)
        try:
            yield self._views(b, i)
        finally:
            self._current = None
            if write_back:
                self._write(b, i)

    def _take(self, i: int) -> int:
        """The ring buffer holding streamed piece i, its read done: the piece open now."""
        b = self._fetch(i)
        self.file.wait(self.pending[b], reads=True)
        self.pending[b] = []
        del self.holds[i]
        self._clock += 1
        self.used[b] = self._clock
        self._current = b
        return b

    def speculable(self, k: int) -> bool:
        return k in self.speculated

    @contextlib.contextmanager
    def speculate(self, k: int, after: int | None = None):
        """Streamed piece k's states in a ring buffer, updated there and written to the slot it was not read
        from; `after`: the next piece the speculation will take, read meanwhile."""
        b = self._take(k)
        if after is not None and after not in self.resident:
            self._claim(after, b)
        try:
            yield self._views(b, k)
        finally:
            self._current = None
            self.pending[b] = self._write_ranges(b, k, slot=self.where[k] ^ 1)
            self.contents[b] = None  # speculative bytes: never taken for the piece's states

    def commit(self, k: int) -> None:
        """Piece k's states are the other slot's now: no buffer may still claim its old bytes."""
        self.where[k] ^= 1
        self.contents = [None if c == k else c for c in self.contents]
        self.holds.pop(k, None)

    def end_speculation(self) -> None:
        self._drain()  # a committed piece's write lands before anything reads its slot

    def _home(self) -> None:
        """Every piece back in the first slot (before a checkpoint copies the file): read from the second,
        written to the first."""
        for k in [k for k, w in enumerate(self.where) if w]:
            b = self._take(k)
            self._current = None
            self.where[k] = 0
            self._write(b, k)
        self._drain()

    def prefetch(self) -> None:
        """Start reading the first streamed pieces of the next walk (the engine calls it as backward starts,
        when the last step's write-backs have drained during the forward); never waits."""
        if self.n_buffers:
            self._read_ahead(len(self.pieces) - 1, None, wrap=True)

    def read(self, i: int, kind: str) -> torch.Tensor:
        """A copy of one kind of unit i's states (gathered_params): unit-sized, not shard-sized."""
        spans = self.spans(i)
        out = torch.empty(spans[-1][2], dtype=torch.float32)
        for k, lo, hi in spans:
            with self.open(k, write_back=False) as states:
                out[lo:hi] = states[KINDS.index(kind)]
        return out

    def write(self, i: int, kind: str, src: torch.Tensor) -> None:
        src = src.reshape(-1)
        for k, lo, hi in self.spans(i):
            with self.open(k) as states:
                states[KINDS.index(kind)].copy_(src[lo:hi])

    def stream(self, read: bool = True, write: bool = True) -> None:
        """Every piece in file order through the ring as a step walks it, without the compute: read (with the
        next one read ahead) and written back; read only; or written only (read=False, whatever the buffers
        hold: a measurement's, not a step's). bench-io's and bench_nvme's measure of the tier's own I/O."""
        n = len(self.pieces)
        for k in (k for k in range(n) if k not in self.resident):
            if read:
                with self.open(k, write_back=write):
                    pass
            else:
                self._write(self._free_buffer(exclude=()), k)
        self._drain()

    def save_file(self, path: Path) -> str:
        """Copy the swap file, which is a checkpoint shard, to `path` (fsynced); returns its sha256. The
        resident pieces are written into the swap file first (their only writes: a checkpoint's cost)."""
        self._home()
        for k in sorted(self.resident):
            self.file.wait(self._write_ranges(None, k))
        with disk_errors(path, "checkpoint write"):
            out = SwapFile(path, self.layout.nbytes, self.file.threads, self.file.request, swap=False)
            try:
                digest = copy_file(self.file, out, self.layout.nbytes)
                os.fsync(out.fd)  # (where a disk's write-back error surfaces)
            finally:
                out.close(remove=False)
        return digest

    def load_file(self, path: Path) -> str | None:
        """Copy a checkpoint shard laid out exactly as this swap file (same header, same size) into it;
        returns the copied bytes' sha256 for the caller to check, or None (nothing done) when the layout
        differs: another partitioning, or a checkpoint written before shards were laid out this way."""
        try:
            if path.stat().st_size != self.layout.nbytes:
                return None
            with open(path, "rb") as f:
                if f.read(len(self.layout.header)) != self.layout.header:
                    return None
        except OSError:
            return None
        self._drain()
        self.holds.clear()
        self.contents = [None] * self.n_buffers  # what the ring holds is the old run's
        self.where = [0] * len(self.pieces)  # (the second slots hold nothing of the loaded states)
        src = SwapFile.existing(path, self.file.threads, self.file.request)
        try:
            digest = copy_file(src, self.file, self.layout.nbytes)
        finally:
            src.close(remove=False)
        for k in sorted(self.resident):  # the resident pieces from the copied file
            self.file.wait(self._read_into(None, k))
        return digest

    def resident_bytes(self, shards: list[torch.Tensor]) -> int:
        return sum(b.nbytes for b in self.buffers) + (self.kept.nbytes if self.kept is not None else 0)

    @property
    def files(self) -> list[SwapFile]:
        return [self.file] + ([self.spec_file] if self.spec_file is not None else [])

    def disk_bytes(self) -> int:
        """The swap file and the second slots' (made or still to be: they are planned)."""
        return self.file.nbytes + self._second_file[1]

    def close(self) -> None:
        """Wait for the write-backs (an I/O error among them is raised) and close, the files removed all the
        same: a failed disk must not leave a run's swap files behind on it."""
        try:
            self._drain()
        finally:
            for f in self.files:
                f.close()
