"""Ports that cannot be stolen (issue 67, item 2). Rank 0's process-group store listens on a port that the
launcher's node chooses at the rendezvous and rank 0 binds seconds later, once it has started. torch picks
that port by binding port 0 and closing it (`get_free_port`): from then until rank 0's bind any process can
take it, and CI met EADDRINUSE there. Here the port is bound once, as it is chosen, and handed over:

- `HeldPortStore` wraps the store torch's rendezvous handler writes each round's MASTER_ADDR/MASTER_PORT to.
  When rank 0's node writes the port, the store binds a port of its own on that address (`hold_port`, port
  0: always free), writes that one instead, and keeps the socket. torch reads the value back from the store,
  so every node, and rank 0, get the held port.
- rank 0 binds beside the hold (SO_REUSEPORT, network.bound_listener); nobody else can, not even a process
  setting SO_REUSEADDR; the hold never listens, so every connection reaches rank 0's store.
- the hold is let go when the next round begins or the launcher shuts down (network.PortHolding).

Cost: the handler's store calls go through Python (a few per round and heartbeat), not straight to C++."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

ADDR_KEY, PORT_KEY = (
    "/MASTER_ADDR",
    "/MASTER_PORT",
)  # torch's RendezvousStoreInfo keys, under the round's prefix


def hold_port(addr: str, port: int) -> socket.socket:
    """Bind `addr`:`port` without listening, so that no other user's process (nor one of ours without
    SO_REUSEPORT) can bind it, while rank 0's bound_listener still can. A socket that does not listen takes
    no connection: they all go to rank 0's."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Bound first, SO_REUSEPORT after: a bind with it set would succeed beside another of the user's
        # SO_REUSEPORT listeners (another run's store) and rank 0 would join that one's group, its clients
        # reaching the other run. No SO_REUSEADDR: with it, any process setting SO_REUSEADDR could bind
        # beside a socket that does not listen, and then listen.
        sock.bind((addr, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        sock.close()
        raise
    return sock


class HeldPortStore(dist.Store):
    """`inner` (the rendezvous' TCPStore) with rank 0's port chosen and held as it is published (above).
    `held` is the hold of the latest round this node published a port in; `release()` lets it go."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner
        self.held: socket.socket | None = None
        self._addr: str | None = None

    def set(self, key: str, value) -> None:
        if key.endswith(ADDR_KEY):
            self._addr = _text(value)
        elif key.endswith(PORT_KEY) and self._addr is not None:
            self.release()
            self.held = hold_port(self._addr, 0)
            value = str(self.held.getsockname()[1]).encode()
        self.inner.set(key, value)

    def release(self) -> None:
        if self.held is not None:
            self.held.close()
            self.held = None

    # The rest is the inner store's, as torch's handler and agent call it.
    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)  # (through set: a port published this way is held too)

    def append(self, key: str, value) -> None:
        self.inner.append(key, value)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)
