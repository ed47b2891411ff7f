"""Loaded at start-up by every Python process of a test that puts this folder on PYTHONPATH (the launcher, the
rank server and so every rank forked from it): faults patched in from outside. The production code carries no
hook for any of them.

A pause inside a checkpoint save, once every rank has written its files and before they are gathered and
renamed, so a test can kill a rank while the save is half done.
  ZOFF_TEST_PAUSE_IN_SAVE: seconds to pause; ZOFF_TEST_PAUSE_FLAG: a file written when the pause begins.

A failing disk: the os calls the swap files and the checkpoint writers make (os.pwritev/preadv from the disk
tier's I/O threads, os.write, and os.fsync, which every checkpoint file passes through and where a real disk's
write-back error surfaces) raise OSError(EIO or ENOSPC) for files whose path matches a glob, after the first
N such calls of the process went through. From then on every matching call fails, as a dead disk does.
  ZOFF_TEST_IO_FAULT: eio or enospc;  ZOFF_TEST_IO_FAULT_PATH: an fnmatch glob on the file's real path;
  ZOFF_TEST_IO_FAULT_OPS: the calls, comma-separated (default pwritev,pwrite,write,fsync; also preadv);
  ZOFF_TEST_IO_FAULT_AFTER: matching calls that succeed first (default 0), counted per process;
  ZOFF_TEST_IO_FAULT_RANK: only in the rank of this RANK; ZOFF_TEST_IO_FAULT_FLAG: a file written at the fault.
"""

import errno
import fnmatch
import os
import threading
import time
from pathlib import Path

if float(os.environ.get("ZOFF_TEST_PAUSE_IN_SAVE", "0") or 0):
    import torch.distributed as dist

    _gather = (
        dist.all_gather_object
    )  # zoff calls it only to gather a save's file list (checkpoint/__init__.py)

    def _paused_gather(*args, **kwargs):
        flag = os.environ.get("ZOFF_TEST_PAUSE_FLAG")
        if flag:
            Path(flag).write_text("paused")
        time.sleep(float(os.environ["ZOFF_TEST_PAUSE_IN_SAVE"]))
        return _gather(*args, **kwargs)

    dist.all_gather_object = _paused_gather


_FAULTS = {"eio": errno.EIO, "enospc": errno.ENOSPC}
_seen = [0]  # matching calls so far in this process (the I/O threads share it)
_lock = threading.Lock()


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _should_fail(fd: int) -> str | None:
    """The path to fail the call on, or None: a matching file, past the first N calls, in the chosen rank.
    (RANK is read per call: the ranks' environment is set after this module ran, in the rank server.)"""
    rank = os.environ.get("ZOFF_TEST_IO_FAULT_RANK")
    if rank is not None and os.environ.get("RANK") != rank:
        return None
    path = _fd_path(fd)
    if not fnmatch.fnmatch(path, os.environ["ZOFF_TEST_IO_FAULT_PATH"]):
        return None
    with _lock:
        _seen[0] += 1
        if _seen[0] <= int(os.environ.get("ZOFF_TEST_IO_FAULT_AFTER", "0")):
            return None
    flag = os.environ.get("ZOFF_TEST_IO_FAULT_FLAG")
    if flag and not os.path.exists(flag):
        Path(flag).write_text(path)
    return path


def _faulty(name: str, real):
    code = _FAULTS[os.environ["ZOFF_TEST_IO_FAULT"]]

    def call(fd, *args, **kwargs):
        path = _should_fail(fd)
        if path is not None:
            raise OSError(code, os.strerror(code), path)
        return real(fd, *args, **kwargs)

    call.__name__ = name
    return call


if os.environ.get("ZOFF_TEST_IO_FAULT"):
    for _name in os.environ.get("ZOFF_TEST_IO_FAULT_OPS", "pwritev,pwrite,write,fsync").split(","):
        setattr(os, _name, _faulty(_name, getattr(os, _name)))
