"""Start the ranks through torch.distributed elastic (torchrun's engine): rendezvous, restarts, recorded errors."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
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
from zoff.host.process_exit import end_at_exit
from zoff.launch import liveness, rank_server
from zoff.launch.network import (
    BOUND_STORE_ENV,
    LOOPBACK,
    RDZV_BACKEND,
    Liveness,
    init_process_group,
    network_env,
    node_address,
    register_rendezvous,
)
from zoff.launch.rank_server import START_METHOD, prepare, threads_per_rank
from zoff.trainer import regather

# Set for the ranks of a rendezvous round after the first (a node lost or joined: torch's restart count stays 0
# for such a membership change): they resume from the latest checkpoint, as restarted ranks do.
REFORMED_ENV = "ZOFF_REFORMED"
TORCH_STOP_GRACE_S = 30  # torch < 2.12: PContext.close's fixed wait before SIGKILL, which no setting changes


def check_torch() -> None:
    """The torch this launcher needs (pyproject.toml says why), checked before anything is written."""
    if "signals_to_handle" not in ElasticConfig.__dataclass_fields__:
        raise UserError(
            f"zoff needs torch 2.11 or later (this is {torch.__version__}): its elastic launcher is the first "
            "that lets a second signal kill the ranks"
        )


def stop_grace_note(lc: LaunchConfig) -> str | None:
    """What a stop really gets on a torch whose launcher has no shutdown_timeout (2.11), or None.

    torch 2.11 gives the ranks a fixed 30 s between the stop signal and SIGKILL: a checkpoint that takes
    longer is cut off, so the start-up says so rather than promising launch.shutdown_timeout_s.
    """
    if (
        "shutdown_timeout" in ElasticConfig.__dataclass_fields__
        or lc.shutdown_timeout_s <= TORCH_STOP_GRACE_S
    ):
        return None
    return (
        f"zoff: torch {torch.__version__} gives stopped ranks {TORCH_STOP_GRACE_S} s to checkpoint before "
        f"SIGKILL, not launch.shutdown_timeout_s={lc.shutdown_timeout_s} (torch 2.12 or later honours it)"
    )


def launch(cfg: Config, run_dir: Path, resume: str | None = None) -> None:
    """Run `cfg` on launch.nproc_per_node local workers (and more nodes via rendezvous); raise on failure."""
    check_torch()
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
        # every listener bound to one address (network.py): loopback on a single node; across nodes the
        # endpoint's for the rendezvous store, this node's (launch.interface or the route) for the rest
        rdzv_endpoint=f"{LOOPBACK}:0" if standalone else lc.rdzv_endpoint,
        rdzv_backend=RDZV_BACKEND,
        local_addr=node_address(lc),
        rdzv_configs={
            "timeout": 900,
            "last_call_timeout": lc.rdzv_last_call_s,
            "keep_alive_interval": lc.rdzv_keep_alive_s,
        },
        max_restarts=lc.max_restarts,
        monitor_interval=0.2,
        start_method=START_METHOD,  # forked from a server that has imported the trainer (rank_server.py)
        signals_to_handle=StopSignals.LEFT_TO_TORCH,  # SIGTERM and SIGINT are StopSignals' (below)
        # on SIGTERM/SIGINT, ranks finish the step and checkpoint first (torch 2.11 has a fixed 30 s)
        **(
            {"shutdown_timeout": lc.shutdown_timeout_s}
            if "shutdown_timeout" in ElasticConfig.__dataclass_fields__
            else {}
        ),
    )
    note = stop_grace_note(lc)
    if note:
        print(note, file=sys.stderr, flush=True)
    env = launch_env(
        lc
    )  # the agent's; the ranks get them as an argument (a fork server's environment is older)
    os.environ.update(env)
    register_rendezvous(_liveness(lc, env))
    prepare()
    stops = StopSignals(lc.shutdown_timeout_s)
    try:
        with stops, agent_log(run_dir / "logs" / "elastic"):
            elastic_launch(elastic, worker)(cfg.to_dict(), str(run_dir), resume, env)
    except SignalException as e:
        # The first signal's; a second one's Abort may replace it in torch's clean-up, whichever it is
        raise Preempted(stops.first or e.sigval, stops.second) from None
    except ChildFailedError as e:
        rank, first = next(iter(e.failures.items()))  # keyed by global rank
        msg = first.message
        detail = msg.get("message", str(msg)) if isinstance(msg, dict) else str(msg or "")
        if not detail:
            detail = f"see {first.error_file or 'its log'}"
        raise WorkerFailed(f"rank {rank} failed (exit code {first.exitcode}): {detail}") from None


def _liveness(lc: LaunchConfig, env: dict[str, str]) -> Liveness:
    """What this agent does when a node is lost (liveness.py). `env` is the dict the ranks get as an argument,
    pickled anew at each start: a mark set in it reaches the next round's ranks."""

    def peers_lost(line: str) -> None:
        liveness.say(line)
        kill_ranks()  # blocked in a collective with the lost node: only launch.timeout_s would end them

    def store_lost(line: str) -> None:
        liveness.say(line)
        kill_ranks()
        rank_server.stop_now()
        os._exit(liveness.LOST_EXIT)  # the agent's own clean-up would wait on the unreachable store

    def round_done(rnd: int | None) -> None:
        if rnd:
            env[REFORMED_ENV] = "1"

    return Liveness(lc.nproc_per_node, peers_lost, store_lost, round_done)


class agent_log:
    """torch elastic's own log lines (a failed rank's traceback among them) go to a file under `folder`
    (one per agent), not the terminal, while the agent runs: the terminal gets zoff's lines."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.handler: logging.Handler | None = None
        self.logger = logging.getLogger("torch.distributed.elastic")

    def __enter__(self) -> agent_log:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"agent-{socket.gethostname()}-{os.getpid()}.log"
        self.handler = logging.FileHandler(path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.logger.addHandler(self.handler)
        self.logger.propagate = False
        return self

    def __exit__(self, *exc) -> None:
        self.logger.propagate = True
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.handler.close()


class WorkerFailed(RuntimeError):
    """A worker died; the message holds its recorded error."""


class Preempted(RuntimeError):
    """The launcher got SIGTERM/SIGINT and the ranks are gone: they stopped after the step (and checkpointed,
    if they could) within launch.shutdown_timeout_s, or a second signal (`aborted_by`) killed them. Whether a
    checkpoint exists is for the checkpoint directory to say (zoff/checkpoint/status.py)."""

    def __init__(self, sig: int, aborted_by: int | None = None):
        super().__init__(f"signal {sig}")
        self.signal = int(sig)
        self.aborted_by = None if aborted_by is None else int(aborted_by)

    @property
    def exit_code(self) -> int:
        """128 + the signal that ended the run, as a shell reports a process killed by it."""
        return 128 + (self.aborted_by or self.signal)


@record
def pg_timeout_s(backend: str, timeout_s: float) -> float:
    """The process group's own timeout. gloo raises it in the waiting call (Comm turns that into a
    CollectiveError). NCCL's watchdog instead aborts the process once a collective passes it, with no word of
    which rank is missing; zoff's host waits (Comm.sum_scalars, once a step) use launch.timeout_s, so the
    watchdog gets twice that and the named CollectiveError comes first for steps shorter than the timeout."""
    return 2 * timeout_s if backend == "nccl" else timeout_s


def launch_env(lc: LaunchConfig) -> dict[str, str]:
    """The variables the launcher sets for its agent and its ranks."""
    return {
        "OMP_NUM_THREADS": str(threads_per_rank(lc, lc.nproc_per_node)),
        **network_env(lc),
        BOUND_STORE_ENV: "1",
        # Rank 0 serves a fresh process-group store per attempt (network.init_process_group): torch 2.13's
        # shared agent store is reused across restarts without a per-attempt prefix (a restarted rank can read
        # the last attempt's addresses and hang or be refused), and it listens on every interface.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def worker(cfg_dict: dict, run_dir: str, resume: str | None = None, env: dict | None = None) -> None:
    """One rank: the launcher's variables (launch_env), threads, device, process group, then the trainer."""
    from zoff.trainer.preempt import STOP

    STOP.install()  # first: a SIGTERM during start-up must still end in a checkpointed stop
    os.environ.update(env or {})
    from zoff.engine.comm.gather_checks import SkippedBlockError  # (in the child: keeps the launcher light)
    from zoff.trainer.run import run_training

    # The modules the rank server imported (and this rank's own so far) are never garbage: kept out of every
    # collection, so that none walks their ~180,000 objects (0.1 s a full one with torch loaded), the one at
    # exit included, nor writes to the pages a forked rank still shares with the server.
    gc.freeze()
    cfg = regather.with_classes(config_from_dict(cfg_dict), regather.recorded(Path(run_dir))[0])
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
    init_process_group(backend, timedelta(seconds=pg_timeout_s(backend, cfg.launch.timeout_s)))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts > 0 or os.environ.get(REFORMED_ENV) == "1":
        resume = (
            "auto"  # a restarted or re-formed group continues from the latest complete checkpoint by itself
        )
    try:
        run_training(cfg, Path(run_dir), device, resume)
    except SkippedBlockError as e:  # zoff train restarts the ranks gathering the holding module whole
        regather.note(Path(run_dir), e.block_class, str(e))
        raise SystemExit(f"zoff: error: {e}") from None
    except UserError as e:
        raise SystemExit(f"zoff: error: {e}") from None
    except Exception as e:
        _restart_line(e, restarts)
        raise
    finally:
        dist.destroy_process_group()
    # torch's wrapper hands the agent this rank's result, then multiprocessing's sys.exit ends the process: at
    # once, without the ~0.8 s teardown the launcher would wait for (process_exit.py)
    end_at_exit()
    if STOP.requested:
        # Checkpointed and done: leave now. torch's worker wrapper would otherwise wait for an event the
        # agent's shutdown path never sets, until launch.shutdown_timeout_s runs out and it is killed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _restart_line(e: Exception, restarts: int) -> None:
    """A failure the agents restart the job for: one line on this rank's console (its traceback goes to the
    agent's log, agent_log). The last failure says nothing here: `zoff train`'s final lines name it."""
    if restarts >= int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
        return
    first = (str(e).strip().splitlines() or [""])[0]
    liveness.say(
        f"zoff: rank {os.environ.get('RANK', '?')} failed: {type(e).__name__}: {first}; the job restarts from "
        f"the last checkpoint (restart {restarts + 1} of {os.environ['TORCHELASTIC_MAX_RESTARTS']})"
    )


# ------------------------------------------------------------------------------------- stop signals


class Abort(SignalException):
    """A second SIGTERM/SIGINT: the ranks are killed. A SignalException, so torch's agent treats it as the
    signal it is (it keeps a multi-node rendezvous open for the other nodes, as for the first one)."""


class StopSignals:
    """The launcher's SIGTERM/SIGINT handling while the elastic agent runs.

    First signal: raise SignalException where the main thread is, as torch's own handler does; the agent
    forwards the signal to the ranks (they finish the step and checkpoint, zoff/trainer/preempt.py) and waits
    up to launch.shutdown_timeout_s for them. Second signal (of either kind): SIGKILL every rank and
    everything it started, then raise Abort. Forwarding the second signal to ranks that are stopped, or
    blocked in a collective where no Python handler runs, would leave the launcher waiting out the whole
    shutdown timeout. torch registers its own handler each time it starts the ranks, for the signals its
    LaunchConfig.signals_to_handle names, which would replace this one: SIGTERM and SIGINT are left off it.
    """

    LEFT_TO_TORCH = "SIGHUP,SIGQUIT"  # torch's default list without SIGTERM and SIGINT

    def __init__(self, shutdown_timeout_s: int):
        self.shutdown_timeout_s = shutdown_timeout_s
        self.first: int | None = None
        self.second: int | None = None
        self._previous: dict[int, object] = {}
        self._redelivering = 0  # signals sent again by _redeliver and not yet handled

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # else torch's handlers stay in charge
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        # After a stop, the previous handler (Python's KeyboardInterrupt) would turn a signal still on its
        # way - one _redeliver sent, or the user's next Ctrl-C - into a traceback from wherever the exit
        # has got to (CI caught one in the fork server's atexit). The ranks are gone by now: a redelivered
        # signal is dropped, a new one ends the launcher at once.
        late = self._late if self.first is not None or self._redelivering else None
        for sig, handler in self._previous.items():
            signal.signal(sig, late or handler)

    def _late(self, signum: int, frame) -> None:
        if self._redelivering:
            self._redelivering -= 1
            return
        _say(f"zoff: {signal.Signals(signum).name} again: exiting now")
        os._exit(128 + signum)

    def _redeliver(self, signum: int) -> None:
        self._redelivering += 1
        _redeliver(signum)

    def _handle(self, signum: int, frame) -> None:
        sig = signal.Signals(signum)
        if self._redelivering:  # this one or the user's, in the same 50 ms: handled alike
            self._redelivering -= 1
        # An exception raised while the agent is inside logging is caught by logging itself, which prints a
        # traceback and goes on as if no signal came: a first signal would be lost (no checkpoint, the run
        # goes on). Deliver it again a moment later, outside the log call.
        if _inside_logging(frame) and (self.first is None or self.second is not None):
            self._redeliver(signum)
            return
        # os.write, not print: the main thread may be inside a write to sys.stderr, which is not reentrant.
        if self.first is None:
            self.first = signum
            _say(
                f"zoff: {sig.name}: asking the ranks to finish their step and checkpoint (waiting up to "
                f"launch.shutdown_timeout_s = {self.shutdown_timeout_s} s); send SIGTERM or Ctrl-C again "
                "to kill them at once, without a checkpoint"
            )
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        if self.second is None:
            self.second = signum
            kill_ranks()
            # The agent only has dead processes to reap now; should its clean-up still block, nothing is left
            # to wait for: leave anyway.
            _exit_later(10.0, 128 + signum)
            if _inside_logging(frame):  # the ranks are dead already; Abort again once out of the log call
                self._redeliver(signum)
                return
        raise Abort(f"Process {os.getpid()} got a second signal: {sig}", sigval=sig)


def _inside_logging(frame) -> bool:
    """Whether the signal interrupted a logging call (whose handlers swallow what is raised in them)."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "logging":
            return True
        frame = frame.f_back
    return False


def _redeliver(signum: int, after_s: float = 0.05) -> None:
    """Send `signum` to this process again after `after_s`, from a timer thread (the handler runs in the main
    thread, once the log call it interrupted has returned)."""
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def _say(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _exit_later(seconds: float, code: int) -> None:
    def leave() -> None:
        _say(
            f"zoff: the launcher's clean-up did not finish {seconds:.0f} s after the ranks were killed; exiting"
        )
        os._exit(code)

    timer = threading.Timer(seconds, leave)
    timer.daemon = True
    timer.start()


def kill_ranks() -> int:
    """SIGKILL this process's ranks (its multiprocessing children) and every process below them; returns how
    many ranks. SIGKILL works on stopped processes too. The tree is read before anything is killed: a killed
    rank's children would be re-parented and lost from it."""
    ranks = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
    children = _children_table()
    victims, todo = [], list(ranks)
    while todo:
        pid = todo.pop()
        victims.append(pid)
        todo += children.get(pid, [])
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(ranks)


def _children_table() -> dict[int, list[int]]:
    """ppid -> child pids of every process, from /proc (Linux); empty elsewhere, where only the ranks die."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return children
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "(comm)": state, ppid
        children.setdefault(ppid, []).append(int(entry))
    return children
