"""zoff's exceptions: bad user input (the CLI turns it into one line on stderr and exit code 2), and a disk's
I/O error met mid-run (DiskError: `zoff train` ends the run with one line naming the file, exit 1)."""

import contextlib
import os
from collections.abc import Iterator


class UserError(Exception):
    """Bad input from the user (config, CLI argument, checkpoint). The message names the key or file."""

    def __init__(self, message: object = "") -> None:
        # Always one line, whatever it quotes (a key or a path with a newline in it).
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


class ConfigError(UserError):
    """A config key is unknown, mistyped or out of range."""


def os_error(cause: OSError, message: str) -> OSError:
    """An OSError that reads as its one-line message (no "[Errno N]" prefix) and keeps the cause's errno:
    what an I/O path raises so that the caller's one-line error can quote it."""
    err = OSError(message)
    err.errno = cause.errno
    return err


class DiskError(OSError):
    """An I/O error (EIO, ENOSPC, ...) on a file read or written mid-run: a swap file, a checkpoint being
    written. It keeps the cause's errno, names the file and says what was being done (`what`: "swap write at
    byte 8,192", "checkpoint write"); `zoff train` ends the run with it in one line (trainer/disk_error.py)."""

    def __init__(self, cause: OSError, path: object, what: str) -> None:
        # (a cause made by os_error has its message in args and no strerror: the errno's own text stands in)
        reason = cause.strerror or (os.strerror(cause.errno) if cause.errno else str(cause))
        super().__init__(cause.errno, reason, str(cause.filename or path))
        self.what = what
        self.step: int | None = None  # the training step, where the code that raised knows it (a save's)

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {self.strerror}: {self.filename}"

    def __reduce__(self):  # (a pickled copy, e.g. across a process pool, is one again)
        return _disk_error, (self.errno, self.strerror, self.filename, self.what)


def _disk_error(errno: int, strerror: str, path: str, what: str) -> DiskError:
    return DiskError(OSError(errno, strerror), path, what)


@contextlib.contextmanager
def disk_errors(path: object, what: str) -> Iterator[None]:
    """Any OSError inside becomes a DiskError naming `path` (where the error has no file name of its own: an
    fsync's) and `what`; a DiskError from deeper down passes as it is."""
    try:
        yield
    except DiskError:
        raise
    except OSError as e:
        raise DiskError(e, path, what) from None
