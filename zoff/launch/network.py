"""What a run listens on. torch's own stores bind every interface and have no authentication: anyone who can
reach a port can read and write a run's store. zoff binds each listener to one address instead:

- a single node: loopback only (its rendezvous store, rank 0's process-group store, the gloo/NCCL sockets);
- several nodes: the rendezvous store on the endpoint's own address (on the node that hosts it), rank 0's
  process-group store and the ranks' sockets on this node's address toward the others: the one of the
  interface launch.interface names, else the one the system routes to the endpoint."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler

from zoff.config import LaunchConfig
from zoff.errors import UserError
from zoff.launch.liveness import StoreWatch, lost_peers_line, lost_store_line, round_members, stale_peers
from zoff.launch.port_hold import HeldPortStore, hold_port  # noqa: F401 (hold_port: the tests' helper's too)

LOOPBACK = "127.0.0.1"
RDZV_BACKEND = "zoff-c10d"  # torch's c10d rendezvous on a store zoff binds (below)
# Set by the launcher for its ranks: rank 0's process-group store listens on MASTER_ADDR only (worker()).
BOUND_STORE_ENV = "ZOFF_BOUND_STORE"
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def bound_listener(addr: str, port: int = 0, beside_hold: bool = False) -> tuple[int, int]:
    """A TCP socket listening on `addr`:`port` only (0: any free port): (its file descriptor, for
    TCPStore(master_listen_fd=...), which owns it from then on, its port). `beside_hold` (rank 0's store
    alone): SO_REUSEPORT, to bind beside the launcher's hold on the port (hold_port). Never for the rendezvous
    store: a second agent on the machine must meet EADDRINUSE there and join the first as a client (with
    SO_REUSEPORT both would listen, each its own rendezvous, and wait for ever)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if beside_hold:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return sock.detach(), port


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (launch.interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise UserError(
                f"launch.interface: '{name}' has no IPv4 address on this machine ({e.strerror})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def interface_of(addr: str) -> str | None:
    """The name of the interface holding IPv4 address `addr`, or None."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == addr:
                return name
        except UserError:  # an interface with no IPv4 address
            continue
    return None


def endpoint_address(endpoint: str) -> tuple[str, int]:
    """(IPv4 address, port) of launch.rdzv_endpoint HOST:PORT."""
    host, _, port = endpoint.rpartition(":")
    try:
        return socket.gethostbyname(host), int(port)
    except (OSError, ValueError) as e:
        raise UserError(
            f"launch.rdzv_endpoint: cannot resolve '{endpoint}' to an IPv4 address ({e})"
        ) from None


def node_address(lc: LaunchConfig) -> str:
    """The address this node's listeners bind and the other nodes reach it at: loopback on a single node, the
    named interface's across nodes, else the one the system routes toward the rendezvous endpoint."""
    if lc.rdzv_endpoint is None:
        return LOOPBACK
    ip, port = endpoint_address(lc.rdzv_endpoint)
    host = lc.rdzv_endpoint.rpartition(":")[0]
    spans = int(lc.nnodes.split(":")[-1]) > 1
    if spans and ip.startswith("127.") and host != "localhost" and not _is_ip(host):
        # Debian-style /etc/hosts maps the machine's own name to 127.0.1.1: the store would listen where no
        # other node can reach it, and the run would wait out the rendezvous timeout
        raise UserError(
            f"launch.rdzv_endpoint: '{host}' resolves to the loopback address {ip} on this machine, which other "
            "nodes cannot reach: give the endpoint's routable address"
        )
    if lc.interface:
        return interface_address(lc.interface)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))  # a UDP connect sends nothing: it only asks the routing table
        except OSError as e:
            raise UserError(f"launch.rdzv_endpoint: no route to {lc.rdzv_endpoint} ({e.strerror})") from None
        return s.getsockname()[0]


def _is_ip(host: str) -> bool:
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True


def _rendezvous(params):
    """torch's c10d rendezvous (its handler and backend) on a store bound to the endpoint's address: the node
    where that address is local hosts it (on a single node, 127.0.0.1:0), the others connect to it."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, _, port_s = params.endpoint.rpartition(":")
    ip, port = socket.gethostbyname(host), int(port_s)
    try:
        fd, port = bound_listener(ip, port)
    except OSError as e:  # not this machine's address, or another agent here hosts it already
        if e.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
            raise
        fd = None
    store = dist.TCPStore(
        ip, port, is_master=fd is not None, multi_tenant=True, master_listen_fd=fd,
        timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)),
    )  # fmt: skip

    interval, attempts = (
        params.get_as_int("keep_alive_interval", 5),
        params.get_as_int("keep_alive_max_attempt", 3),
    )
    watch = StoreWatch(interval * (attempts + 1))  # one interval past the others' wait before they drop us

    class BoundBackend(C10dRendezvousBackend):
        name = property(lambda self: RDZV_BACKEND)  # torch checks the backend's name against the launcher's

        def get_state(self):
            return watch.call(super().get_state)

        def set_state(self, state, token=None):
            return watch.call(super().set_state, state, token)

    ports = HeldPortStore(store)  # the handler publishes rank 0's port through it: held as it is chosen
    handler = create_handler(ports, BoundBackend(store, params.run_id), params)
    return PortHolding(handler, watch, params.endpoint, interval, attempts, ports)


@dataclass
class Liveness:
    """What the launcher does when a node is lost (liveness.py): `peers_lost(line)` on the survivors (kill this
    node's ranks: the agent then re-forms the job), `store_lost(line)` on the cut-off node (stop, exit non-zero),
    `round_done(round)` after each rendezvous round (the ranks of a later round resume from the checkpoint)."""

    nproc: int
    peers_lost: Callable[[str], None]
    store_lost: Callable[[str], None]
    round_done: Callable[[int | None], None]  # None: a torch whose handler keeps no round where we look


_LIVENESS: list[
    Liveness
] = []  # the launcher's, set by register_rendezvous (torch's registry takes params alone)


class PortHolding(RendezvousHandler):
    """torch's rendezvous handler, and on the node of rank 0 the hold on the port of rank 0's process-group
    store (port_hold.py: bound as it is chosen), from the round that published it until the next round or the
    shutdown; and the node's liveness (liveness.py)."""

    def __init__(
        self,
        inner: RendezvousHandler,
        watch: StoreWatch,
        endpoint: str,
        interval: int,
        attempts: int,
        ports: HeldPortStore,
    ):
        self.inner, self.ports = inner, ports
        self.watch, self.endpoint, self.interval, self.attempts = watch, endpoint, interval, attempts
        self.members: tuple[int, dict] | None = None  # the current round's (liveness.round_members)

    def next_rendezvous(self):
        self.ports.release()  # the last round's port: its rank 0 has gone
        info = self.inner.next_rendezvous()
        if _LIVENESS:
            state = getattr(getattr(self.inner, "_state_holder", None), "state", None)
            _LIVENESS[0].round_done(getattr(state, "round", None))
            self.members = round_members(self.inner)
            self.watch.start(self._store_lost)
        return info

    def _store_lost(self, waited_s: float) -> None:
        _LIVENESS[0].store_lost(lost_store_line(self.endpoint, waited_s, self.interval * self.attempts))

    def num_nodes_waiting(self) -> int:
        """torch's count of nodes waiting to join; and where another participant's heartbeat has stopped, that
        node named, this node's ranks stopped, and 1 (the agent restarts the group: the rendezvous drops it)."""
        waiting = self.inner.num_nodes_waiting()
        lost = stale_peers(self.inner, self.members, self.interval, self.attempts) if self.members else []
        if lost:
            self.members = None  # said once; the agent now re-forms the job
            _LIVENESS[0].peers_lost(lost_peers_line(lost, _LIVENESS[0].nproc, self.interval, self.attempts))
            return max(waiting, 1)
        return waiting

    def shutdown(self) -> bool:
        self.ports.release()
        return self.inner.shutdown()

    def get_backend(self) -> str:
        return self.inner.get_backend()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def __getattr__(self, name: str):
        if name == "inner":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.inner, name)  # what a later torch's handler adds, as torch's own handler has it


def register_rendezvous(liveness: Liveness | None = None) -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    _LIVENESS[:] = [liveness] if liveness else []
    if not rendezvous_handler_registry._registry.get(RDZV_BACKEND):
        rendezvous_handler_registry.register(RDZV_BACKEND, _rendezvous)


def network_env(lc: LaunchConfig) -> dict[str, str]:
    """Where the ranks' gloo and NCCL sockets listen: the loopback interface on a single node; across nodes
    the one launch.interface names, else the one holding the address routed to the endpoint (else the
    libraries' own choice); a variable the user set wins."""
    iface = "lo" if lc.rdzv_endpoint is None else lc.interface or interface_of(node_address(lc))
    if iface is None:
        return {}
    return {
        k: v
        for k, v in {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}.items()
        if k not in os.environ
    }


def init_process_group(backend: str, timeout: timedelta) -> None:
    """Join the run's process group over a store rank 0 serves on MASTER_ADDR only (its node's address, which
    the launcher gave the rendezvous as local_addr); without the launcher's mark, torch's env:// store."""
    if os.environ.get(BOUND_STORE_ENV) != "1":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(
        addr,
        port,
        world,
        rank == 0,
        timeout,
        master_listen_fd=bound_listener(addr, port, beside_hold=True)[0] if rank == 0 else None,
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
