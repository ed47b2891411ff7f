"""The port of rank 0's process-group store cannot be stolen between the rendezvous and rank 0's bind (issue
67, item 2): torch's rendezvous picks a free port and closes it, and rank 0 binds it seconds later, after it
has started; CI met EADDRINUSE there (test_cpu_precision, 2026-12-02). The launcher now binds the port as it
publishes it (port_hold.HeldPortStore) and holds it for the round; rank 0 binds beside the hold, nobody else
can."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from zoff.launch.network import LOOPBACK, bound_listener
from zoff.launch.port_hold import HeldPortStore, hold_port

GRAB = """
import socket, sys
s = socket.socket()
if sys.argv[2] == "reuseaddr":  # as most servers do
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen(1)
except OSError as e:
    print(e.errno)
else:
    print(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _grab(port: int) -> int:
    """Another process's bind and listen on `port`, plain and with SO_REUSEADDR: the errno both met (0: they
    got the port)."""
    codes = {
        int(subprocess.run([sys.executable, "-c", GRAB, str(port), how], capture_output=True, text=True,
                           timeout=60).stdout)
        for how in ("plain", "reuseaddr")
    }  # fmt: skip
    assert len(codes) == 1, codes
    return codes.pop()


def test_a_held_port_is_refused_to_others_and_served_by_rank_0() -> None:
    port = _free_port()
    assert _grab(port) == 0  # (free: the plant below can fail)
    held = hold_port(LOOPBACK, port)
    try:
        assert _grab(port) == errno.EADDRINUSE
        fd, bound = bound_listener(LOOPBACK, port, beside_hold=True)  # rank 0, beside the hold
        assert bound == port
        server = dist.TCPStore(
            LOOPBACK, port, 2, True, timedelta(seconds=30), wait_for_workers=False, master_listen_fd=fd
        )
        client = dist.TCPStore(LOOPBACK, port, 2, False, timedelta(seconds=30))
        client.set("k", "v")  # a connection reaches the listener, not the hold
        assert server.get("k") == b"v"
        del client, server
    finally:
        held.close()
    assert _grab(port) == 0  # released with the hold


def test_the_port_is_held_as_it_is_published_and_every_node_reads_the_held_one() -> None:
    """torch's own RendezvousStoreInfo.build, as the rendezvous handler calls it each round, over the store
    zoff gives the handler: rank 0's node publishes a port that is already held (no moment when it is free);
    another node reads the same port; the next round lets it go."""
    inner = dist.TCPStore(LOOPBACK, 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=30))
    ports = HeldPortStore(inner)
    first = RendezvousStoreInfo.build(0, dist.PrefixStore("torch.rendezvous.r.1", ports), LOOPBACK)
    assert ports.held is not None and first.master_port == ports.held.getsockname()[1]
    assert _grab(first.master_port) == errno.EADDRINUSE
    other = RendezvousStoreInfo.build(1, dist.PrefixStore("torch.rendezvous.r.1", inner), "10.0.0.9")
    assert (other.master_addr, other.master_port) == (LOOPBACK, first.master_port)
    second = RendezvousStoreInfo.build(0, dist.PrefixStore("torch.rendezvous.r.2", ports), LOOPBACK)
    assert second.master_port != first.master_port  # a restart's round: the old port let go, a new one held
    assert _grab(first.master_port) == 0 and _grab(second.master_port) == errno.EADDRINUSE
    ports.release()
    assert _grab(second.master_port) == 0


def _refused_beside(beside_hold: bool, bind) -> None:
    """`bind(port)` beside a listener (SO_REUSEPORT where `beside_hold`) meets EADDRINUSE."""
    fd, port = bound_listener(LOOPBACK, 0, beside_hold=beside_hold)
    try:
        with pytest.raises(OSError) as e:
            bind(port)
        assert e.value.errno == errno.EADDRINUSE
    finally:
        socket.socket(fileno=fd).close()


def test_a_second_rendezvous_store_on_the_port_is_refused() -> None:
    """The rendezvous store's listener takes no SO_REUSEPORT: a second agent on the machine meets EADDRINUSE
    and joins the first as a client (with it, both listened, each its own rendezvous, and the two-agent test
    hung)."""
    _refused_beside(False, lambda port: bound_listener(LOOPBACK, port))


def test_a_hold_never_joins_another_runs_reuseport_listener() -> None:
    """Another of the user's runs listening with SO_REUSEPORT on the port (its rank-0 store): the hold fails
    rather than sharing it, which would load-balance this run's clients onto that run's store."""
    _refused_beside(True, lambda port: hold_port(LOOPBACK, port))
