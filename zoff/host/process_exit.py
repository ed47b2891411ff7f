"""Ending a process that has torch loaded without the interpreter's teardown.

Python's own exit clears every module and collects what they held; with torch imported that takes ~0.8 s
of one core (more with the trainer loaded) and changes nothing a run leaves behind. Every `zoff` command
and every rank of a run pays it before its parent can go on: the launcher waits for its ranks' teardown,
then its own. `exit_now` ends the process as the interpreter would, minus that teardown: non-daemon threads
joined, atexit handlers run (logging's flush, multiprocessing's finalizers, weakref.finalize), every open
file's buffer flushed (the teardown would flush a file some object still holds), then the exit code.
"""

from __future__ import annotations

import atexit
import gc
import io
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
    files = [o for o in gc.get_objects() if isinstance(o, io.IOBase)]  # (~0.2 s with the trainer loaded)
    for f in [*files, sys.stdout, sys.stderr]:
        try:
            if not f.closed:
                f.flush()
        except (OSError, ValueError, AttributeError):  # a closed pipe: as the interpreter, no word
            code = code or (120 if f is sys.stdout else 0)
    os._exit(code)


def end_at_exit() -> None:
    """From now on, sys.exit(code) ends the process with exit_now. For a process whose last steps are other
    code's: a rank's result goes back through torch's worker wrapper, and multiprocessing then ends the process
    with sys.exit(exitcode), a failure in between included."""
    sys.exit = lambda code=None: exit_now(exit_code(code))
