"""What a run listens on: a single node on loopback only (its rendezvous store, rank 0's process-group store,
the ranks' gloo/NCCL sockets), several nodes on the interface the user names (launch.interface)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from zoff.config import LaunchConfig

LOOPBACK = "127.0.0.1"
LOOPBACK_RDZV = "zoff-loopback"  # the standalone rendezvous handler (below)
# Set for the ranks of a single-node run: rank 0's process-group store listens on loopback only (worker()).
LOOPBACK_ENV = "ZOFF_LOOPBACK"


def loopback_listener(port: int = 0) -> tuple[int, int]:
    """A TCP socket listening on 127.0.0.1:`port` (0: any free port): (its file descriptor for
    TCPStore(master_listen_fd=...), which owns it from then on, its port). torch's own stores bind every interface:
    anyone on the network could read and write a single-node run's store, which has no authentication."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return sock.detach(), port


def _loopback_rendezvous(params):
    """torch's c10d rendezvous (the same handler and backend as rdzv_backend c10d) on a store that listens on
    loopback only: a single-node run needs nobody from outside."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    fd, port = loopback_listener()
    store = dist.TCPStore(
        LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=fd, timeout=timedelta(seconds=60)
    )

    class LoopbackBackend(C10dRendezvousBackend):
        name = property(lambda self: LOOPBACK_RDZV)  # torch checks the backend's name against the launcher's

    return create_handler(store, LoopbackBackend(store, params.run_id), params)


def register_loopback_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if not rendezvous_handler_registry._registry.get(LOOPBACK_RDZV):
        rendezvous_handler_registry.register(LOOPBACK_RDZV, _loopback_rendezvous)


def network_env(lc: LaunchConfig) -> dict[str, str]:
    """Where the ranks' gloo and NCCL sockets listen: the loopback interface on a single node, the interface
    launch.interface names across nodes (else the libraries' own choice); a variable the user set wins."""
    iface = "lo" if lc.rdzv_endpoint is None else lc.interface
    if iface is None:
        return {}
    return {
        k: v
        for k, v in {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}.items()
        if k not in os.environ
    }


def init_process_group(backend: str, timeout: timedelta) -> None:
    """Join the run's process group: on one node (LOOPBACK_ENV, set by the launcher) over a store rank 0
    serves on loopback only; across nodes through torch's env:// store."""
    if os.environ.get(LOOPBACK_ENV) != "1":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world, port = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(
        LOOPBACK,
        port,
        world,
        rank == 0,
        timeout,
        master_listen_fd=loopback_listener(port)[0] if rank == 0 else None,
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
