"""A single-node run listens on loopback only: its rendezvous store, rank 0's process-group store and the
ranks' gloo sockets (issue 33: torch's defaults listened on every interface, and a store has no
authentication). Read from /proc while a real 2-rank `zoff train` runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.forked_zoff import zoff_run
from zoff.config import config_from_dict
from zoff.errors import ConfigError, UserError
from zoff.launch.network import interface_address, network_env

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


def _listening_while_training(tmp_path: Path, *args: str) -> set[tuple[str, int]]:
    """Every TCP listener of a 2-rank `zoff train` and its children, sampled from /proc while it runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    p = subprocess.Popen(
        [sys.executable, "-m", "zoff", "train", str(REPO / "configs" / "tiny.yaml"), "train.max_steps=40",
         "log.progress=false", "launch.nproc_per_node=2", "--run-dir", str(tmp_path / "run"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline:
        seen |= _listeners(_socket_inodes(_descendants(p.pid)))
        time.sleep(0.05)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0, out[-3000:]
    return seen


@pytest.mark.slow
def test_a_single_node_run_listens_on_loopback_only(tmp_path: Path) -> None:
    seen = _listening_while_training(tmp_path)
    # the rendezvous store, rank 0's store and gloo's pair listeners (one per rank at least)
    assert len(seen) >= 3, seen
    assert {addr for addr, _ in seen} <= LOOPBACK, seen


def _proc_net(ip: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (little-endian hex)."""
    return socket.inet_aton(ip)[::-1].hex().upper()


def _non_loopback_ipv4() -> str | None:
    for _, name in socket.if_nameindex():
        try:
            ip = interface_address(name)
        except UserError:
            continue
        if not ip.startswith("127."):
            return ip
    return None


@pytest.mark.slow
def test_a_run_across_nodes_listens_only_on_the_address_routed_to_its_endpoint(tmp_path: Path) -> None:
    """Run as a one-node member of a multi-node rendezvous at this machine's own non-loopback address: the
    rendezvous store binds the endpoint's address, rank 0's store and gloo the routed one: nothing binds
    every interface (0.0.0.0 / ::), as torch's own c10d stores do."""
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with socket.socket() as s:  # a free port for the endpoint
        s.bind((ip, 0))
        port = s.getsockname()[1]
    seen = _listening_while_training(tmp_path, "--rdzv-endpoint", f"{ip}:{port}")
    assert len(seen) >= 3 and (_proc_net(ip), port) in seen, seen
    assert {addr for addr, _ in seen} == {_proc_net(ip)}, seen


def test_a_named_interface_that_does_not_exist_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    p = zoff_run(
        ["train", str(REPO / "configs" / "tiny.yaml"), "launch.interface=nosuch0", "--rdzv-endpoint",
         "127.0.0.1:29999", "--run-dir", str(tmp_path / "run")],
        timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "zoff: error: launch.interface: 'nosuch0' has no IPv4 address on this machine (No such device)"
    ], p.stderr
    assert not (tmp_path / "run").exists()


def test_the_ranks_sockets_use_loopback_on_one_node_and_the_named_interface_across_nodes(monkeypatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    one = config_from_dict({}).launch
    assert network_env(one) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    many = config_from_dict({"launch": {"rdzv_endpoint": "127.0.0.1:29500", "nnodes": "2"}}).launch
    assert network_env(many) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}  # the routed one
    named = config_from_dict({"launch": {"rdzv_endpoint": "10.0.0.1:29500", "interface": "eth1"}}).launch
    assert network_env(named) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's own setting wins
    assert network_env(named) == {"GLOO_SOCKET_IFNAME": "eth1"}
    with pytest.raises(ConfigError, match=r"^launch\.interface: expected a network interface name"):
        config_from_dict({"launch": {"interface": "eth0; rm -rf /"}})


def test_an_endpoint_name_that_resolves_to_loopback_is_refused_across_nodes(tmp_path: Path) -> None:
    """Debian maps a machine's own name to 127.0.1.1: a store bound there is unreachable from other nodes."""
    name = socket.gethostname()
    if not socket.gethostbyname(name).startswith("127."):
        pytest.skip(f"{name} resolves to a routable address here")
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "train", str(REPO / "configs" / "tiny.yaml"), "--nnodes", "2",
         "--rdzv-endpoint", f"{name}:29999", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert f"launch.rdzv_endpoint: '{name}' resolves to the loopback address" in lines[0]
    assert not (tmp_path / "run").exists()
