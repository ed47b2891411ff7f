"""A node lost to its network, seen from both sides, beside the collectives (issue 67 item 4).

torch's agents send a heartbeat to the rendezvous store every launch.rdzv_keep_alive_s, but only look at the
others' during a rendezvous: while training, a node cut off from the others was found only when a collective
ran past launch.timeout_s (600 s by default), and the cut-off node itself waited on the unreachable store for
up to the rendezvous' join timeout (900 s), its ranks blocked. Here:

- the survivors: the agent's monitor loop already reads the rendezvous state every 0.2-1 s
  (num_nodes_waiting); `stale_peers` reads the participants' heartbeats from it, by torch's own rule (no
  heartbeat for keep_alive_s x keep_alive_max_attempt: dead, the rule its rendezvous removes nodes by). A lost
  node's ranks are named in one line, this node's ranks are killed (blocked in a collective with the lost one,
  they would only wait out launch.timeout_s) and the job re-forms without it from the last checkpoint;
- the cut-off node: `StoreWatch` times every call the agent makes to the rendezvous store (its monitor loop,
  its heartbeats, its rendezvous). A call unanswered for one heartbeat interval longer than the others wait
  before they drop this node means the others have gone on without it: one line, its ranks killed, exit 1.

Cost: one comparison per state read, one timer thread per agent. A link that comes back within those bounds
leaves the run untouched (TCP retransmits; the collectives only waited). The heartbeats are compared with this
node's clock, as torch's rendezvous already does: the nodes' clocks must agree to well within a heartbeat
interval (NTP does). Reads private attributes of torch's handler (2.11-2.13); where a later torch renames
them, `stale_peers` finds nothing and a lost node is found by the collective timeout, as before.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

LOST_EXIT = 1  # the cut-off node's exit code: a failed run (its checkpoints stay valid for a resume)


def say(line: str) -> None:
    """One line on the launcher's stderr (os.write: the main thread may be inside a write to sys.stderr)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def round_members(handler) -> tuple[int, dict] | None:
    """(round, {node: node rank}) of the round torch's handler has just completed, or None."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    if state is None or not hasattr(state, "round"):
        return None
    return state.round, dict(getattr(state, "participants", {}))


def stale_peers(
    handler, members: tuple[int, dict], interval_s: float, attempts: int
) -> list[tuple[str, int]]:
    """(address, node rank) of each other member of the round that torch's handler has since dropped from its
    participants (its state sync drops a node silent for interval_s x attempts) or whose last heartbeat is that
    old, read from the state the handler last synced. Nothing once the round has changed (torch's own restart)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    this = getattr(handler, "_this_node", None)
    rnd, nodes = members
    if state is None or this is None or getattr(state, "round", None) != rnd:
        return []
    beats, now = getattr(state, "last_heartbeats", {}), datetime.now(timezone.utc)
    expire = now - timedelta(seconds=interval_s * attempts)
    return sorted(
        (node.addr, rank)
        for node, rank in nodes.items()
        if node != this and (node not in state.participants or beats.get(node, now) < expire)
    )


def lost_peers_line(lost: list[tuple[str, int]], nproc: int, interval_s: float, attempts: int) -> str:
    """The survivors' line: each lost node with its global ranks (nodes of `nproc` ranks each)."""
    named = ", ".join(
        f"{addr} (rank{'s' if nproc > 1 else ''} "
        + ",".join(str(r) for r in range(rank * nproc, (rank + 1) * nproc))
        + ")"
        for addr, rank in lost
    )
    return (
        f"zoff: lost node {named}: no heartbeat for {interval_s * attempts:g} s (launch.rdzv_keep_alive_s="
        f"{interval_s:g} x {attempts}); re-forming without it from the last checkpoint"
    )


class StoreWatch:
    """How long the agent's calls to the rendezvous store have gone unanswered: from the last answered one,
    while a call waits or the last one failed (a call that times out, after the store's read timeout, must not
    start the count again). `start` runs a timer thread that calls `lost(seconds)` once that reaches
    `bound_s`, once."""

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self._lock = threading.Lock()
        self._waiting: set[int] = set()  # the threads whose call is under way
        self._failed = False
        self._answered = time.monotonic()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable, *args):
        """fn(*args), timed."""
        me = threading.get_ident()
        with self._lock:
            self._waiting.add(me)
        ok = False
        try:
            out = fn(*args)
            ok = True
            return out
        finally:
            with self._lock:
                self._waiting.discard(me)
                self._failed = not ok
                if ok:
                    self._answered = time.monotonic()

    def waited_s(self) -> float:
        with self._lock:
            stuck = bool(self._waiting) or self._failed
            return time.monotonic() - self._answered if stuck else 0.0

    def start(self, lost: Callable[[float], None]) -> None:
        if self._thread is not None:
            return
        with self._lock:
            self._answered = time.monotonic()

        def watch() -> None:
            every = min(1.0, self.bound_s / 4)
            while (waited := self.waited_s()) < self.bound_s:
                time.sleep(every)
            lost(waited)

        self._thread = threading.Thread(target=watch, name="zoff-store-watch", daemon=True)
        self._thread.start()


def lost_store_line(endpoint: str, waited_s: float, others_wait_s: float) -> str:
    return (
        f"zoff: lost the other nodes: the rendezvous store at {endpoint} has not answered for {waited_s:.0f} s "
        f"(they drop a node silent for {others_wait_s:g} s and go on without it); stopping this node"
    )
