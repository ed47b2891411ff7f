"""Ports that cannot be stolen (issue 67, item 2): many launches beside a process that takes every port it
can get, and none fails.

The grabber binds and listens on port 0 as fast as it can and keeps its newest sockets (about a fifth of the
ephemeral range), as a busy host's other servers, clients and launchers do. A port picked by bind(0) and
closed, then bound again seconds later (torch's get_free_port for rank 0's store, the tests' old free_port
for the rendezvous endpoint) is taken in that window in about half the launches: planted by making
HeldPortStore publish a port it no longer holds, this test fails with rank 0's EADDRINUSE."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.processes import Agent, free_port, losses

GRABBER = """
import collections, socket, sys
keep = collections.deque()
taken = 0
while True:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
    except OSError:
        s.close()
        continue
    keep.append(s)
    taken += 1
    if taken == 2000:
        print("grabbing", flush=True)
    if len(keep) > int(sys.argv[1]):
        keep.popleft().close()
"""


@pytest.fixture
def grabber():
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    proc = subprocess.Popen(
        [sys.executable, "-c", GRABBER, str((high - low) // 5)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "grabbing"
        yield proc
    finally:
        proc.kill()
        proc.wait()


LAUNCHES = 6


def test_many_launches_beside_a_port_grabber_all_train(tmp_path, grabber) -> None:
    """Single-node runs (the rendezvous store on port 0, rank 0's store on the port held as published) and a
    two-agent run on an endpoint from the tests' helper: every one trains to the end."""
    steps = ["train.max_steps=2", "checkpoint.every_steps=0"]
    for i in range(LAUNCHES):
        Agent(tmp_path / f"single{i}" / "run", *steps, name=f"single{i}").ok()
        assert grabber.poll() is None  # (still grabbing)
        time.sleep(0.2)  # (the grabber's churn reaches the ports just freed)
    endpoint = f"127.0.0.1:{free_port()}"
    time.sleep(2)  # the window a fresh endpoint waits before its first agent binds it, made long
    nodes = [
        Agent(
            tmp_path / "two" / "run", *steps, "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node",
            "1", "--rdzv-endpoint", endpoint, name=f"node{r}",
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        for node in nodes:
            node.ok()
    finally:
        for node in nodes:
            node.cleanup()
    assert sorted(losses(tmp_path / "two" / "run")) == [1, 2]
