"""The disk tier's I/O engine: a rank's swap files (optimizer states, gradients, parameters), each read and
written with O_DIRECT from page-aligned buffers by small thread pools. Pure Python + torch: no libaio, no
compiled op.

O_DIRECT moves data between the disk and the buffer without the page cache: a 100 GB shard streamed every
step would otherwise evict everything else the host caches and count against its memory. It needs the
offset, the length and the buffer address aligned (4096 covers every device here); regions are laid out on
4096-byte boundaries and buffers come from anonymous mmaps, which are page-aligned. A filesystem without
O_DIRECT (tmpfs) falls back to buffered I/O with one warning. os.preadv/pwritev release the GIL during the
syscall, so `threads` requests of `request_bytes` run in parallel and the disk sees deep, large,
sequential I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import stat
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zoff.errors import DiskError, UserError, os_error

ALIGN = 4096
HUGE_PAGE = 2 << 20  # x86-64 transparent huge page: buffers this large ask for them (AlignedBuffer)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class AlignedBuffer:
    """A page-aligned host buffer (anonymous mmap) seen as a uint8 tensor; O_DIRECT can read into it."""

    def __init__(self, nbytes: int, huge_pages: bool = True):
        self.nbytes = aligned(max(nbytes, 1))
        # private: a shared anonymous map (Python's default) is shmem, counted as page cache ("Cached")
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Transparent huge pages where the host allows them ("madvise" is the usual default): O_DIRECT pins
        # every page of a request, and 2 MiB pages cut the kernel's time per byte 5-7x and raised this VM's
        # O_DIRECT bandwidth 22% (reads) and 35% (writes) (scripts/bench_io_contention.py), cores
        # the forward and the CPU Adam get back. Cost: none in bytes (the buffers are filled whole); a fault
        # may compact memory for a huge page (defrag "madvise"), once per buffer, as buffers are pooled.
        if huge_pages and self.nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # (a kernel without THP: plain pages)
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
        """`numel` elements of `dtype` from byte offset `start` (a multiple of the element size)."""
        return self.bytes[start : start + numel * dtype.itemsize].view(dtype)


class SwapFile:
    """A preallocated file of `nbytes` that aligned regions are read from and written to asynchronously."""

    def __init__(
        self, path: Path, nbytes: int, threads: int = 4, request_bytes: int = 8 << 20, *, swap: bool = True
    ):
        """Create (truncate) `path` with `nbytes` reserved. `swap=False`: a checkpoint file copied to or from
        a swap file (copy_file), with no warnings about the disk tier."""
        self.path, self.nbytes = path, aligned(nbytes)
        self.request = max(ALIGN, aligned(request_bytes))
        self.role = "swap" if swap else "checkpoint"  # what an I/O error says it was doing (DiskError)
        if swap:
            # Swap folders are often shared scratch disks: never write through a name someone else planted. The
            # rank's folder must be a real folder of this user's; whatever is at the file's name (a stale swap
            # file, a link, a hard link to someone's file) loses its name, and a new file is made, O_EXCL and
            # O_NOFOLLOW: no existing inode is ever opened, truncated or written.
            private_folder(path.parent)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        # a swap file is private to the run; a checkpoint file is as readable as the others beside it (umask)
        self._open(flags, warn=swap, mode=0o600 if swap else 0o666)
        fs = filesystem_type(path.parent)
        if swap and fs in ("tmpfs", "ramfs"):
            print(f"zoff: warning: {path.parent} is on {fs}, in memory: the disk tier saves no RAM there")
        try:
            # A swap file's space is claimed now: ENOSPC here, not mid-step. Not a checkpoint copy's: where the
            # filesystem has no fallocate (NFS and other network filesystems, common for checkpoints) glibc
            # emulates it by writing every block, which would write the shard twice; a full disk fails the
            # copy instead, naming the file, with the previous checkpoint untouched.
            if swap:
                os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as e:
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise os_error(e, f"zoff: cannot reserve {self.nbytes:,} bytes in {path}: {e.strerror}") from None
        self.owned = True  # close() may remove it
        self._start(threads)

    def grow(self, nbytes: int) -> None:
        """Claim the file's space up to `nbytes` (speculation's second regions, claimed at the first speculated
        step: a run that never speculates never takes them); ENOSPC names the file."""
        nbytes = aligned(nbytes)
        if nbytes <= self.nbytes:
            return
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:  # mid-run (a speculated step): ends the run like any disk error there
            raise DiskError(e, self.path, f"reserving {nbytes:,} bytes") from None
        self.nbytes = nbytes

    @classmethod
    def existing(cls, path: Path, threads: int = 4, request_bytes: int = 8 << 20) -> SwapFile:
        """An existing file opened for reading only (O_DIRECT where the filesystem has it)."""
        self = cls.__new__(cls)
        self.path, self.request = path, max(ALIGN, aligned(request_bytes))
        self.role = "checkpoint"
        self._open(os.O_RDONLY, warn=False)
        self.nbytes = os.fstat(self.fd).st_size
        self.owned = False  # someone else's file (a checkpoint's): close() never removes it
        self._start(threads)
        return self

    def _open(self, flags: int, warn: bool, mode: int = 0o600) -> None:
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), mode)
        except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
            self.direct = False
            self.fd = os.open(self.path, flags, mode)
            if warn:
                print(
                    f"zoff: warning: {self.path.parent} does not support O_DIRECT; swapping through the page cache"
                )

    def _start(self, threads: int) -> None:
        self.threads = threads
        # Reads and writes have pools of their own: a read the step waits for never queues behind the
        # write-backs, and the disk has both directions in flight at once (the threads mostly sleep in the
        # syscall; cost: `threads` more idle threads).
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zoff-io-read")
        self.wpool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zoff-io-write")
        self.read_bytes = self.written_bytes = 0
        self._count = threading.Lock()
        self.wait_s = 0.0  # time the caller spent blocked on this file's I/O (the step's "disk wait")
        self.read_wait_s = 0.0  # the part of it spent on reads, where the caller knows they are reads

    def wait(self, futures: list[Future], reads: bool = False) -> None:
        """Block until `futures` (of this file's reads or writes) are done, counting the time in wait_s (and
        read_wait_s when they are reads)."""
        if futures:
            t0 = time.perf_counter()
            wait(futures)
            dt = time.perf_counter() - t0
            with self._count:  # (the overlapped step waits on one file from two threads)
                self.wait_s += dt
                self.read_wait_s += dt if reads else 0.0

    def _chunks(self, buf: torch.Tensor, offset: int) -> list[tuple[memoryview, int]]:
        assert offset % ALIGN == 0 and buf.numel() % ALIGN == 0, "swap regions are 4096-aligned"
        mv = memoryview(buf.numpy()).cast("B")
        return [(mv[a : a + self.request], offset + a) for a in range(0, len(mv), self.request)]

    def read(self, buf: torch.Tensor, offset: int) -> list[Future]:
        """Fill `buf` (uint8, from an AlignedBuffer) from the file at `offset`; wait on the futures."""
        self.read_bytes += buf.numel()
        return [
            self.pool.submit(_full, os.preadv, self.fd, mv, off, self.path, f"{self.role} read")
            for mv, off in self._chunks(buf, offset)
        ]

    def write(self, buf: torch.Tensor, offset: int) -> list[Future]:
        self.written_bytes += buf.numel()
        return [
            self.wpool.submit(_full, os.pwritev, self.fd, mv, off, self.path, f"{self.role} write")
            for mv, off in self._chunks(buf, offset)
        ]

    def close(self, remove: bool = True) -> None:
        """Wait for the I/O in flight and close; `remove` deletes the file and its folder once that is empty
        (a rank's folder under the user's nvme_path, which itself stays)."""
        self.pool.shutdown(wait=True)
        self.wpool.shutdown(wait=True)
        os.close(self.fd)
        if remove and self.owned:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


def copy_file(src: SwapFile, dst: SwapFile, nbytes: int) -> str:
    """Bytes [0, nbytes) of `src` into `dst` (both 4096-aligned sizes), file to file; returns their sha256.

    Two page-aligned chunk buffers of threads x request bytes alternate: chunk c+1 is read while chunk c is
    hashed and written, so the copy runs at the disk's pace with O_DIRECT on both sides (no page cache) and
    RAM holds two chunks whatever the size. hashlib releases the GIL on large buffers, so the hash overlaps
    the I/O threads; a checkpoint's checksum costs no second read of the file."""
    chunk = min(aligned(max(nbytes, 1)), src.request * src.threads)
    bufs = [AlignedBuffer(chunk) for _ in range(2 if nbytes > chunk else 1)]
    spans = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
    digest = hashlib.sha256()
    writes: list[list[Future]] = [[] for _ in bufs]
    reads = src.read(bufs[0].bytes[: aligned(spans[0][1])], 0) if spans else []
    try:
        for c, (off, n) in enumerate(spans):
            b = c % len(bufs)
            src.wait(reads, reads=True)
            if c + 1 < len(spans):
                nb = (c + 1) % len(bufs)
                dst.wait(writes[nb])
                reads = src.read(bufs[nb].bytes[: aligned(spans[c + 1][1])], spans[c + 1][0])
            digest.update(memoryview(bufs[b].bytes[:n].numpy()))
            writes[b] = dst.write(bufs[b].bytes[: aligned(n)], off)
        for w in writes:
            dst.wait(w)
    finally:  # a failed request (a full disk): nothing of this copy stays in flight on either file
        futures.wait([f for f in reads + [f for w in writes for f in w] if not f.done()])
    return digest.hexdigest()


def private_folder(folder: Path) -> None:
    """Make (0700) or accept `folder` for this run's swap files: a real folder, not a link, owned by this user;
    a UserError naming it otherwise (a link planted on a shared disk would send the swap elsewhere)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise os_error(e, f"zoff: cannot make the swap folder {folder}: {e.strerror}") from None
    problem = folder_problem(folder)
    if problem is not None:
        raise UserError(f"zoff: {problem}")


def folder_problem(folder: Path) -> str | None:
    """Why an existing `folder` is no place for this run's swap files (a link, not a folder, another user's);
    None when it is fine or does not exist yet (zoff train's pre-flight asks before the engine makes it)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{folder} is a link or not a folder; the disk tier swaps only into a real folder"
    if st.st_uid != os.getuid():
        return f"{folder} belongs to another user (uid {st.st_uid}); remove it or use another path"
    return None


def shared_folder_problem(folder: Path) -> str | None:
    """Why a swap folder is open to other users: writable by group or others without the sticky bit (with it,
    as on /tmp, no one else can rename or remove this user's rank folders), or None."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}, not sticky)"
    return None


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/self/mounts)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    target = str(path.resolve())
    best = max(
        (m for m in mounts if target == m[0] or target.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=("", "unknown"),
    )
    return best[1]


def _full(op, fd: int, mv: memoryview, offset: int, path: Path, what: str) -> None:
    """One request, retried until every byte moved (preadv/pwritev may return short counts). It runs on an
    I/O thread: an error (EIO, ENOSPC) is the future's, raised where the caller waits on it (wait())."""
    done = 0
    while done < len(mv):
        try:
            n = op(fd, [mv[done:]], offset + done)
        except OSError as e:
            raise DiskError(e, path, f"{what} at byte {offset + done:,}") from None
        if n <= 0:
            raise OSError(f"zoff: {path} ended at byte {offset + done:,}")
        done += n


def wait(futures: list[Future]) -> None:
    for f in futures:
        f.result()
