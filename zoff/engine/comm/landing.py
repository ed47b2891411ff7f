"""Gradient landings off the autograd thread: a finished reduction is copied down into its tier (staging's
device-to-host chunks, the host add or copy, the norm fold, the disk tier's write) by one worker thread, in
the order the reductions finished, while backward goes on issuing the next units' kernels.

Why: run inline, a landing blocks the thread that runs backward. On a GPU, Staging.download first orders
its side stream after everything the compute stream has queued, then waits on an event per chunk, so the
host stalls once per unit until the GPU has drained its queue, and the next kernels launch only after the
host copy and the norm: the GPU idles between units (issue 32). On the disk tier the host copy, the norm and
the wait for a free gradient buffer sat on backward's thread the same way.

Bounded: the worker takes one landing at a time; `pending` counts those queued or running, and the reducer
keeps reductions in flight plus pending landings within its pooled buffers (reduce.MAX_IN_FLIGHT + 1, what
planning.buffers counts): backward waits only when that many buffers are taken (by reductions the network
has not finished, or by landings). Ordered: one
worker, first in first out, so the micro-batches of an accumulation window add into a unit in the order they
were reduced. Exact: the same operations on the same values, only on another thread. A landing's error is
raised on the caller's thread at the next submit, wait or join, and at every one after (the engine joins
before each step): nothing lands once one has failed, so no step reads a window with a landing missing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Landings:
    """A first-in-first-out queue of landings run by one worker thread (started on first use)."""

    def __init__(self, name: str = "zoff-landing"):
        self._name = name
        # The norm folded at landing is a parallel fp64 sum whose rounding follows the thread split, and a new
        # thread need not get the count set on the thread that built the engine (in a spawned test rank at
        # set_num_threads(1) it did not: its grad norms differed from inline landings in the last bit,
        # tests/integration/test_grad_offload.py): the worker sets the builder's count itself.
        self._threads = torch.get_num_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._queue: deque[Future] = deque()
        self._lock = threading.Lock()  # submit and wait may come from autograd's thread and the main one
        self._failed: BaseException | None = None
        self._raised = False  # the first raise is the error itself; later ones name it as their cause
        self.landed = 0  # landings completed (tests: the worker really ran them)

    @property
    def pending(self) -> int:
        """Landings queued or running. (Those done are dropped from the front here: a failure is kept in
        _failed, so the queue stays as short as what is in flight rather than a backward's every unit.)"""
        with self._lock:
            while self._queue and self._queue[0].done():
                self._queue.popleft()
            return sum(not f.done() for f in self._queue)

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue `fn` after every landing submitted before it; raises an earlier landing's error instead."""
        self._raise()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=self._name,
                    initializer=torch.set_num_threads, initargs=(self._threads,),
                )  # fmt: skip
            self._queue.append(self._pool.submit(self._run, fn))

    def _run(self, fn: Callable[[], None]) -> None:
        if self._failed is not None:  # after a failure nothing lands: the window's gradients are incomplete
            return
        try:
            fn()
            self.landed += 1
        except BaseException as e:
            self._failed = e
            raise

    def wait_oldest(self) -> None:
        """Block until the oldest pending landing is done (the reducer's bound on buffers in use)."""
        with self._lock:
            oldest = self._queue.popleft() if self._queue else None
        if oldest is not None:
            oldest.exception()  # (waits; the error is raised by _raise)
        self._raise()

    def join(self) -> None:
        """Block until every landing submitted so far is done; raise the first error among them."""
        self.drain()
        self._raise()

    def drain(self) -> None:
        """Block until every landing submitted so far is done, raising nothing (a backward that raised: its
        own error is the one to report, and nothing may change the store once it has left)."""
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for f in queued:
            f.exception()

    def _raise(self) -> None:
        if self._failed is None:
            return
        if not self._raised:
            self._raised = True
            raise self._failed
        # sticky: a store that missed a landing must not be stepped or landed in
        raise RuntimeError(
            f"zoff: a gradient landing failed earlier ({type(self._failed).__name__}: {self._failed}); "
            "this window's gradients are incomplete"
        ) from self._failed

    def close(self) -> None:
        """Wait for what is queued and stop the worker (errors are dropped: the run is ending)."""
        self.drain()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
