"""The disk tier's optimizer states (ZeRO-Infinity's optimizer NVMe offload): one swap file per rank that is,
byte for byte, the rank's checkpoint shard.

The file is a safetensors file laid out by `partition_layout`: per unit, its fp32 master, exp_avg and
exp_avg_sq (`u<i>.master`, ...) as the checkpoint names them, each on a 4096-byte boundary (O_DIRECT's
alignment; zero pad tensors in the gaps). So a checkpoint save is a file-to-file copy of the swap file
(disk_io.copy_file: two chunk buffers, no page cache, the checksum computed on the way) and a resume into the
same partitioning copies the shard back; nothing is converted and no unit passes through the optimizer's
buffers. Another world size or stage reads the shard through the checkpoint's pieces as every tier does.

The step walks the file in pieces: a unit, or a sub-group of at most io.subgroup_mb of states of a larger one.
A piece is three reads (its master, exp_avg and exp_avg_sq ranges) into one page-aligned buffer; up to three
buffers rotate: the piece being stepped, the next one being read, the previous one being written. Host
memory: ring_size x the largest piece's states, whatever the shard's total.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from zoff.engine.disk_io import ALIGN, AlignedBuffer, SwapFile, aligned, copy_file
from zoff.tensorfile import FileLayout, file_layout

KINDS = ("master", "exp_avg", "exp_avg_sq")


def partition_entries(shard_numels: list[int]) -> list[tuple[str, list[int], torch.dtype]]:
    """One rank's optimizer states as tensors of a file: per unit, its three fp32 states, in unit order."""
    return [(f"u{u}.{kind}", [n], torch.float32) for u, n in enumerate(shard_numels) for kind in KINDS]


def partition_layout(shard_numels: list[int]) -> FileLayout:
    """Where partition_entries lie in the swap file and the checkpoint shard: each 4096-aligned."""
    return file_layout(partition_entries(shard_numels), align=ALIGN)


def ring_size(units: int) -> int:
    """Unit buffers of the disk tier: the unit stepped, the next being read, the last being written (fewer
    when there are fewer units: a single unit needs one)."""
    return max(1, min(3, units))


def subgroup_numel(subgroup_mb: int) -> int:
    """Parameters per disk-tier sub-group: its master and two moments (12 B each) fill subgroup_mb, in whole
    pages (4096 elements, so every region stays aligned)."""
    return max(4096, (subgroup_mb << 20) // 12 // 4096 * 4096)


def piece_spans(numel: int, piece: int | None) -> list[tuple[int, int]]:
    """A unit's [lo, hi) pieces of at most `piece` elements (None: the whole unit); at least one piece."""
    step = max(1, piece or numel or 1)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)] or [(0, 0)]


class SwappedStates:
    """Every unit's states in one swap file laid out as its checkpoint shard, stepped piece by piece."""

    def __init__(
        self, shards: list[torch.Tensor], swap_dir: Path, download, *, threads: int, request_bytes: int,
        piece: int | None = None, source=None,
    ):  # fmt: skip
        source = source or shards.__getitem__  # unit i's live shard, for its initial master
        self.pieces = [(i, lo, hi) for i, s in enumerate(shards) for lo, hi in piece_spans(s.numel(), piece)]
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
        self.n_buffers = ring_size(len(self.pieces))
        self.buffers = [AlignedBuffer(3 * max(self.part, default=ALIGN)) for _ in range(self.n_buffers)]
        self.pending: list[list] = [[] for _ in self.buffers]  # futures of the I/O in flight on each buffer
        self.holds: dict[int, int] = {}  # piece -> the buffer holding (or reading) it
        head = AlignedBuffer(len(self.layout.header))
        head.bytes.copy_(torch.frombuffer(bytearray(self.layout.header), dtype=torch.uint8))
        self.file.wait(self.file.write(head.bytes, 0))
        for k, (i, lo, hi) in enumerate(self.pieces):  # initial master from the live shard, zero moments
            buf = self._free_buffer(exclude=())
            master, m, v = self._views(buf, k)
            download(source(i)[lo:hi], master)
            m.zero_()
            v.zero_()
            self._write(buf, k)
        self._drain()

    def spans(self, i: int) -> list[tuple[int, int, int]]:
        """Unit i's pieces as (piece, lo, hi), in order (the step asks per unit: looked up, not searched)."""
        return self._spans[i]

    def _views(self, b: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buf, n, p = self.buffers[b], self.numel[i], self.part[i]
        return tuple(buf.view(torch.float32, k * p, n) for k in range(3))

    def _ranges(self, b: int, i: int) -> list[tuple[torch.Tensor, int]]:
        """Piece i's three (buffer range, file offset) pairs in buffer b."""
        p = self.part[i]
        return [(self.buffers[b].bytes[k * p : (k + 1) * p], off) for k, off in enumerate(self.offsets[i])]

    def _free_buffer(self, exclude) -> int:
        free = [b for b in range(self.n_buffers) if b not in exclude and b not in self.holds.values()]
        b = min(free, key=lambda b: bool(self.pending[b]))  # an idle buffer before one still writing
        self.file.wait(self.pending[b])
        self.pending[b] = []
        return b

    def _write(self, b: int, i: int) -> None:
        tail = 4 * self.numel[i]
        self.pending[b] = []
        for region, off in self._ranges(b, i):
            region[tail:].zero_()  # the page's rest is the file's padding: zeros, so files are reproducible
            self.pending[b] += self.file.write(region, off)

    def _fetch(self, i: int, exclude=()) -> int:
        if i not in self.holds:
            b = self._free_buffer(exclude)
            self.pending[b] = [f for region, off in self._ranges(b, i) for f in self.file.read(region, off)]
            self.holds[i] = b
        return self.holds[i]

    def _drain(self) -> None:
        for b in range(self.n_buffers):
            self.file.wait(self.pending[b])
            self.pending[b] = []

    @contextlib.contextmanager
    def open(self, i: int, following: int | None = None, write_back: bool = True):
        """Piece i's states, resident while the block runs; written back after it (asynchronously), with
        `following` already being read. `write_back=False`: only read (the buffer is simply released)."""
        b = self._fetch(i)
        self.file.wait(self.pending[b], reads=True)
        self.pending[b] = []
        if following is not None and self.n_buffers > 1:
            self._fetch(following, exclude=(b,))
        try:
            yield self._views(b, i)
        finally:
            del self.holds[i]
            if write_back:
                self._write(b, i)

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
        for k in range(n):
            if read:
                with self.open(k, k + 1 if k + 1 < n else None, write_back=write):
                    pass
            else:
                self._write(self._free_buffer(exclude=()), k)
        self._drain()

    def save_file(self, path: Path) -> str:
        """Copy the swap file, which is a checkpoint shard, to `path` (fsynced); returns its sha256."""
        self._drain()
        out = SwapFile(path, self.layout.nbytes, self.file.threads, self.file.request, swap=False)
        try:
            digest = copy_file(self.file, out, self.layout.nbytes)
            os.fsync(out.fd)
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
        src = SwapFile.existing(path, self.file.threads, self.file.request)
        try:
            return copy_file(src, self.file, self.layout.nbytes)
        finally:
            src.close(remove=False)

    def resident_bytes(self, shards: list[torch.Tensor]) -> int:
        return sum(b.nbytes for b in self.buffers)

    def disk_bytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        self._drain()
        self.file.close()
