"""Network namespaces joined by a bridge, for the network-cut tests (design.md section 14): one namespace per
node, each with a veth whose peer sits on a bridge in a `switch` namespace, so that nothing is added to the
machine's own network. A node's link is cut with `ip link set ... down` on its side. Every name holds a token
unique to this object; close() deletes the namespaces (and with them the veths and the bridge)."""

from __future__ import annotations

import os
import secrets
import subprocess

SUBNET = "10.213"  # 10.213.<net>.<node>/24: addresses inside namespaces this helper made, nowhere else


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why these tests cannot run here (one line), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"zoffprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip netns` does not work here ({getattr(e, 'stderr', None) or e})".strip()
    return None


class Nodes:
    """`n` namespaces on one bridge: nodes[i] has address SUBNET.<net>.<i+1> on its veth."""

    def __init__(self, n: int):
        self.token = secrets.token_hex(3)
        self.net = 1 + int(self.token, 16) % 250  # a /24 of its own, for tests running side by side
        self.switch = f"zoffsw-{self.token}"
        self.names = [f"zoff{i}-{self.token}" for i in range(n)]
        self.made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        for ns in (self.switch, *self.names):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            # created in the node's namespace, the peer moved to the switch: nothing touches the root one
            _ip(
                "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch
            )
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def address(self, i: int) -> str:
        return f"{SUBNET}.{self.net}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command on node `i` (`ip netns exec` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.names[i], "link", "set", "eth0", "up")

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()
