"""The rules by which a node lost to its network is found (zoff/launch/liveness.py), on torch's own rendezvous
state objects: which peers the survivors call lost, and when the cut-off node's store calls count as
unanswered. The end-to-end cut: tests/integration/test_network_cut.py (-m netfault)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from zoff.launch.liveness import StoreWatch, lost_peers_line, round_members, stale_peers

A, B, C = (_NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in (1, 2, 3))


def _handler(beats_ago: dict, participants=(A, B, C), rnd: int = 4):
    state = _RendezvousState()
    state.round, state.complete = rnd, True
    state.participants = {n: i for i, n in enumerate(participants)}
    now = datetime.now(timezone.utc)
    state.last_heartbeats = {n: now - timedelta(seconds=s) for n, s in beats_ago.items()}
    return SimpleNamespace(_state_holder=SimpleNamespace(state=state), _this_node=A)


def test_a_peer_silent_past_torchs_rule_or_dropped_by_its_sync_is_lost_and_named_with_its_ranks():
    members = round_members(_handler({A: 0, B: 0, C: 0}))
    assert members == (4, {A: 0, B: 1, C: 2})
    assert stale_peers(_handler({A: 0, B: 1, C: 2}), members, 1.0, 3) == []  # within 3 x 1 s
    assert stale_peers(_handler({A: 0, B: 1, C: 3.5}), members, 1.0, 3) == [("10.0.0.3", 2)]
    dropped = _handler({A: 0, B: 0}, participants=(A, B))  # torch's sync removed C from the participants
    assert stale_peers(dropped, members, 1.0, 3) == [("10.0.0.3", 2)]
    # this node's own stale heartbeat is not a lost peer; a new round (torch's own restart) is not judged
    assert stale_peers(_handler({A: 9, B: 0, C: 0}), members, 1.0, 3) == []
    assert stale_peers(_handler({A: 0, B: 9, C: 9}, rnd=5), members, 1.0, 3) == []
    assert stale_peers(SimpleNamespace(), members, 1.0, 3) == []  # a torch without these attributes
    line = lost_peers_line([("10.0.0.3", 2)], 4, 5.0, 3)
    assert line == (
        "zoff: lost node 10.0.0.3 (ranks 8,9,10,11): no heartbeat for 15 s (launch.rdzv_keep_alive_s=5 x 3); "
        "re-forming without it from the last checkpoint"
    )


def test_the_store_counts_as_lost_only_after_the_bound_without_an_answer():
    watch = StoreWatch(0.4)
    fired: list[float] = []
    watch.start(fired.append)
    for _ in range(8):  # answered calls, one every 0.1 s: never lost
        watch.call(time.sleep, 0.1)
    assert fired == [] and watch.waited_s() == 0.0

    def fail() -> None:
        raise RuntimeError("the store's read timeout")

    try:  # a failed call keeps the count going from the last answer (a timeout must not restart it)
        watch.call(fail)
    except RuntimeError:
        pass
    assert watch.waited_s() > 0
    watch.call(lambda: None)  # answered again: back to 0
    assert watch.waited_s() == 0.0 and fired == []
    release = threading.Event()
    t = threading.Thread(target=watch.call, args=(release.wait,), daemon=True)
    t.start()  # a call that hangs, as one to an unreachable store does
    deadline = time.monotonic() + 10
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
    t.join()
    assert len(fired) == 1 and fired[0] >= 0.4, fired
