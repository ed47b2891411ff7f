"""Start the ranks through torch.distributed elastic (torchrun's engine): rendezvous, restarts, recorded errors."""

from __future__ import annotations

import os
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
from torch.distributed.launcher.api import elastic_launch

from zoff.config import Config, LaunchConfig, config_from_dict
from zoff.errors import UserError


def cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(launch: LaunchConfig, local_world: int) -> int:
    """The rank's fair share of this node's cores, unless the config fixes it.

    The elastic launcher would otherwise leave OMP_NUM_THREADS=1 for multi-rank jobs, and the CPU optimizer
    step would run on one core.
    """
    return launch.threads_per_rank or max(1, cores_available() // max(1, local_world))


def launch(cfg: Config, run_dir: Path, resume: str | None = None) -> None:
    """Run `cfg` on launch.nproc_per_node local workers (and more nodes via rendezvous); raise on failure."""
    lc = cfg.launch
    lo, _, hi = lc.nnodes.partition(":")
    nproc = lc.nproc_per_node
    standalone = lc.rdzv_endpoint is None
    logs = DefaultLogsSpecs(
        log_dir=str(run_dir / "logs" / "elastic"),
        # Rank 0 keeps the console (and its live progress bar); the others' stdout/stderr go to files.
        redirects={r: Std.ALL for r in range(1, nproc)},
    )
    elastic = ElasticConfig(
        min_nodes=int(lo),
        max_nodes=int(hi or lo),
        nproc_per_node=nproc,
        logs_specs=logs,
        run_id=f"zoff-{uuid.uuid4().hex[:8]}" if standalone else f"zoff-{run_dir.name}",
        rdzv_endpoint="localhost:0" if standalone else lc.rdzv_endpoint,
        rdzv_backend="c10d",
        rdzv_configs={"timeout": 900},
        max_restarts=lc.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        shutdown_timeout=lc.shutdown_timeout_s,  # on SIGTERM/SIGINT, ranks finish the step and checkpoint first
    )
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(lc, nproc))
    # torch 2.13 reuses the rendezvous store across restarts without a per-attempt prefix, so a restarted
    # rank can read the previous attempt's addresses and hang or be refused; a fresh store per attempt avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        elastic_launch(elastic, worker)(cfg.to_dict(), str(run_dir), resume)
    except SignalException as e:
        raise Preempted(e.sigval) from None
    except ChildFailedError as e:
        rank, first = next(iter(e.failures.items()))  # keyed by global rank
        msg = first.message
        detail = msg.get("message", str(msg)) if isinstance(msg, dict) else str(msg or "")
        if not detail:
            detail = f"see {first.error_file or 'its log'}"
        raise WorkerFailed(f"rank {rank} failed (exit code {first.exitcode}): {detail}") from None


class WorkerFailed(RuntimeError):
    """A worker died; the message holds its recorded error."""


class Preempted(RuntimeError):
    """The launcher got SIGTERM/SIGINT; the ranks checkpointed (within launch.shutdown_timeout_s) and stopped."""

    def __init__(self, sig: int):
        super().__init__(f"signal {sig}")
        self.signal = int(sig)


@record
def pg_timeout_s(backend: str, timeout_s: float) -> float:
    """The process group's own timeout. gloo raises it in the waiting call (Comm turns that into a
    CollectiveError). NCCL's watchdog instead aborts the process once a collective passes it, with no word of
    which rank is missing; zoff's host waits (Comm.sum_scalars, once a step) use launch.timeout_s, so the
    watchdog gets twice that and the named CollectiveError comes first for steps shorter than the timeout."""
    return 2 * timeout_s if backend == "nccl" else timeout_s


def worker(cfg_dict: dict, run_dir: str, resume: str | None = None) -> None:
    """One rank: threads, device, process group, then the trainer."""
    from zoff.trainer.preempt import STOP

    STOP.install()  # first: a SIGTERM during start-up must still end in a checkpointed stop
    from zoff.trainer.session import run_training  # imported in the child: keeps the launcher process light

    cfg = config_from_dict(cfg_dict)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    threads = threads_per_rank(cfg.launch, local_world)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=pg_timeout_s(backend, cfg.launch.timeout_s)))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"  # a restarted group continues from the latest complete checkpoint by itself
    try:
        run_training(cfg, Path(run_dir), device, resume)
    except UserError as e:
        raise SystemExit(f"zoff: error: {e}") from None
    finally:
        dist.destroy_process_group()
    if STOP.requested:
        # Checkpointed and done: leave now. torch's worker wrapper would otherwise wait for an event the
        # agent's shutdown path never sets, until launch.shutdown_timeout_s runs out and it is killed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
