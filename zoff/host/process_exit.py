"""Ending a process that has torch loaded without the interpreter's teardown.

Python's own exit clears every module and collects what they held; with torch imported that takes ~0.8 s
of one core (more with the trainer loaded) and changes nothing a run leaves behind. Every `zoff` command
and every rank of a run pays it before its parent can go on: the launcher waits for its ranks' teardown,
then its own. `exit_now` ends the process as the interpreter would, minus that teardown: non-daemon threads
joined, atexit handlers run (logging's flush and close, multiprocessing's finalizers, weakref.finalize), cyclic
garbage collected, stdio flushed, then the exit code. What it skips is the teardown's flush of a buffered file
some object still holds open: zoff writes every file in a with-block (its loggers flush each record and
close at atexit). Scanning every object for such files would cost ~0.2 s, and in a forked child would write
the parent's buffered bytes a second time, which is why multiprocessing ends its forked children the same way.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from typing import NoReturn


def exit_code(code: object) -> int:
    """The status the interpreter gives a SystemExit's code: None is 0, an int itself, anything else printed
    to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_now(code: int) -> NoReturn:
    """End this process with `code` after what the interpreter's exit does that anyone can see."""
    threading._shutdown()  # type: ignore[attr-defined]  # (as the interpreter joins them at exit)
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed pipe: as the interpreter, no word
            code = code or (120 if stream is sys.stdout else 0)
    os._exit(code)


def end_at_exit() -> None:
    """From now on, sys.exit(code) ends the process with exit_now. For a process whose last steps are other
    code's: a rank's result goes back through torch's worker wrapper, and multiprocessing then ends the process
    with sys.exit(exitcode), a failure in between included."""
    sys.exit = lambda code=None: exit_now(exit_code(code))
