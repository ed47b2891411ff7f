"""A single-node run listens on loopback only: its rendezvous store, rank 0's process-group store and the
ranks' gloo sockets (issue 33: torch's defaults listened on every interface, and a store has no
authentication). Read from /proc while a real 2-rank `zoff train` runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zoff.config import config_from_dict
from zoff.errors import ConfigError
from zoff.network import network_env

REPO = Path(__file__).resolve().parents[2]
LISTEN = "0A"
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net writes them


def _descendants(pid: int) -> set[int]:
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, grew = {pid}, True
    while grew:
        new = {c for c, p in parents.items() if p in found} - found
        found |= new
        grew = bool(new)
    return found


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # the process ended meanwhile
            continue
    return inodes


def _listeners(inodes: set[str]) -> set[tuple[str, int]]:
    """(address as /proc/net writes it, port) of each listening TCP socket among `inodes`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == LISTEN and f[9] in inodes:
                addr, port = f[1].split(":")
                out.add((addr, int(port, 16)))
    return out


@pytest.mark.slow
def test_a_single_node_run_listens_on_loopback_only(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    p = subprocess.Popen(
        [sys.executable, "-m", "zoff", "train", str(REPO / "configs" / "tiny.yaml"), "train.max_steps=40",
         "log.progress=false", "launch.nproc_per_node=2", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline:
        seen |= _listeners(_socket_inodes(_descendants(p.pid)))
        time.sleep(0.05)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0, out[-3000:]
    # the rendezvous store, rank 0's store and gloo's pair listeners (one per rank at least)
    assert len(seen) >= 3, seen
    assert {addr for addr, _ in seen} <= LOOPBACK, seen


def test_the_ranks_sockets_use_loopback_on_one_node_and_the_named_interface_across_nodes(monkeypatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    one = config_from_dict({}).launch
    assert network_env(one) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    many = config_from_dict({"launch": {"rdzv_endpoint": "10.0.0.1:29500", "nnodes": "2"}}).launch
    assert network_env(many) == {}  # the libraries' choice
    named = config_from_dict({"launch": {"rdzv_endpoint": "10.0.0.1:29500", "interface": "eth1"}}).launch
    assert network_env(named) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's own setting wins
    assert network_env(named) == {"GLOO_SOCKET_IFNAME": "eth1"}
    with pytest.raises(ConfigError, match=r"^launch\.interface: expected a network interface name"):
        config_from_dict({"launch": {"interface": "eth0; rm -rf /"}})
