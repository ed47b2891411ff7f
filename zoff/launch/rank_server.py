"""Where the ranks come from: a fork server that has imported torch and the trainer once.

A rank started by `spawn` is a fresh interpreter that imports torch and zoff's trainer (~2.3 s of one core)
before it can join the rendezvous, and it does so after the launcher has paid the same import for its own
pre-flight: a run's start-up was the two imports back to back. `zoff train` instead starts multiprocessing's
fork server as soon as its config is read (`start`): the server imports RANK_MODULES on one core while the
launcher imports torch and checks the config on the other, and the ranks (and an elastic restart's new ranks)
are forked from it at once. The server does nothing else: no thread, no OpenMP region, no CUDA, so a fork of
it is as clean as a fresh interpreter.

A forked rank inherits the server's environment, taken when the server started, not the launcher's when the
ranks start: OMP_NUM_THREADS (which libgomp reads once, when torch loads it) is set for the server from the
config, and the variables the launcher sets later (launch_env) travel with the rank's arguments.
Torch-free: `zoff train` calls it before importing torch.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
from multiprocessing import forkserver

from zoff.config import LaunchConfig

START_METHOD = "forkserver"
RANK_MODULES = ["zoff.launch.elastic", "zoff.trainer.run"]  # what a rank imports (elastic.worker's own)


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(launch: LaunchConfig, local_world: int) -> int:
    """The rank's fair share of this node's cores, unless the config fixes it.

    The elastic launcher would otherwise leave OMP_NUM_THREADS=1 for multi-rank jobs, and the CPU optimizer
    step would run on one core.
    """
    return launch.threads_per_rank or max(1, cores_available() // max(1, local_world))


def prepare() -> None:
    """What the server imports, should it start now (the ranks' first start starts it where `start` did not)."""
    multiprocessing.set_forkserver_preload(RANK_MODULES)


def start(lc: LaunchConfig) -> None:
    """Start the fork server now, its imports beside the launcher's own start-up, unless this process already
    has one (a server started with other modules still serves: a rank imports what it lacks). It is killed at
    exit (atexit): a run that stops in its pre-flight does not leave it importing."""
    if _server_pid() is not None:
        return
    prepare()
    threads = str(threads_per_rank(lc, lc.nproc_per_node))
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads  # for the server alone: libgomp reads it when torch loads it
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
    if (pid := _server_pid()) is not None:
        atexit.register(_stop, pid)


def _server_pid() -> int | None:
    """The running fork server's pid, None where none runs. multiprocessing keeps it in a private attribute
    (3.10-3.14); read with getattr so that a Python that renames it costs only the kill at exit (the server
    then ends when this process does, once its imports are done: it sees its pipe from us close), never a run."""
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _stop(pid: int) -> None:
    with contextlib.suppress(OSError):  # gone already
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def stop_now() -> None:
    """Kill the fork server now, and multiprocessing's resource tracker (a launcher leaving by os._exit, which
    runs no atexit: the tracker would warn of the killed ranks' semaphores, which the kernel frees anyway)."""
    from multiprocessing import resource_tracker

    tracker = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)  # (private, as above)
    for pid in (_server_pid(), tracker):
        if pid is not None:
            _stop(pid)
