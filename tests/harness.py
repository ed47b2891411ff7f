"""Test utilities: run real ranks over gloo, and the single-process plain-PyTorch reference they must match.

The reference is the contract every engine issue is held to: plain model + torch.optim.AdamW over the same
global batches (one forward over the whole global batch), grad clipping by torch.nn.utils.clip_grad_norm_.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.processes import free_port  # noqa: F401 (the spawns' port where none is held)
from zoff.checkpoint import Checkpointer
from zoff.checkpoint.base_ref import base_reference
from zoff.config import Config, config_from_dict, dump_yaml
from zoff.data import GlobalBatches, load_corpus
from zoff.engine.partition import default_decay
from zoff.launch.network import LOOPBACK, bound_listener, hold_port
from zoff.models import build_model, lm_loss
from zoff.trainer.loop import train_loop
from zoff.trainer.schedule import lr_at
from zoff.trainer.session import build_session

# scripts/gpu_check.sh sets ZOFF_TEST_DEVICE=cuda: the same ranks then run over NCCL, one GPU each, and the
# reference runs on GPU 0. Everywhere else the ranks are host processes over gloo.
TEST_DEVICE = os.environ.get("ZOFF_TEST_DEVICE", "cpu")
BACKEND = "nccl" if TEST_DEVICE == "cuda" else "gloo"


def worlds_under_test(default: tuple[int, ...]) -> tuple[int, ...]:
    """The world sizes a multi-rank test runs: ZOFF_TEST_WORLD (gpu_check.sh: one rank per GPU) or its own."""
    world = os.environ.get("ZOFF_TEST_WORLD")
    return (int(world),) if world else default


def rank_device(rank: int) -> torch.device:
    return (
        torch.device("cuda", rank % torch.cuda.device_count())
        if TEST_DEVICE == "cuda"
        else torch.device("cpu")
    )


def init_rank(rank: int, world: int, **kwargs) -> None:
    """Join the test's process group on this rank's device (gloo on the host, NCCL with ZOFF_TEST_DEVICE=cuda).
    Rank 0's store listens beside the parent's hold on MASTER_PORT (held_port): no other process can have
    taken the port in between, as one could when the parent picked a free port and let it go."""
    if TEST_DEVICE == "cuda":
        torch.cuda.set_device(rank_device(rank))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = kwargs.get("timeout") or dist.distributed_c10d._get_default_timeout(BACKEND)  # (as env:// has)
    fd = bound_listener(addr, port, beside_hold=True)[0] if rank == 0 else None
    store = dist.TCPStore(addr, port, world, rank == 0, timeout, master_listen_fd=fd)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world, **kwargs)


def held_port() -> tuple[int, socket.socket]:
    """A port for a spawn's store, held (network.hold_port, not listening) until the caller closes the socket:
    bound as it is chosen, so nothing can take it before rank 0 binds it beside the hold."""
    sock = hold_port(LOOPBACK, 0)
    return sock.getsockname()[1], sock


def _entry(
    rank: int, world: int, port: int, fn, args: tuple, out: str, env: dict | None = None, cwd=None
) -> None:
    global TEST_DEVICE, BACKEND
    if env is not None:  # a fork server's child starts with the server's environment: the test's instead
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        # and this module was imported by the server: read the test's device again (a cuda test sets it late)
        TEST_DEVICE = os.environ.get("ZOFF_TEST_DEVICE", "cpu")
        BACKEND = "nccl" if TEST_DEVICE == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    gc.freeze()  # the server's imports: out of every collection (and their pages stay shared with it)
    try:
        init_rank(rank, world)
        try:
            result = fn(rank, world, *args)
            torch.save(result, Path(out) / f"rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        import traceback

        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


# Ranks start from a fork server that has imported torch, zoff and the libraries the tests use once per
# session: a fresh interpreter per rank re-imported them every time (~2 s each, transformers ~3 s more; the
# default suite starts hundreds of ranks). The server never runs a torch op, so no thread pool or device state
# is forked; each rank still gets its own process, process group and memory.
# (and zoff's command line, which tests.forked_zoff runs from here)
PRELOAD = ["torch", "torch.distributed", "zoff.engine", "zoff.trainer.run", "tests.harness"]
PRELOAD += ["zoff.cli", "zoff.launch.elastic", "zoff.checkpoint.convert", "zoff.planning.disk_room"]
_context = None


def _rank_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        extra = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is not None]
        _context.set_forkserver_preload(PRELOAD + extra)
    return _context


def spawn(fn, world: int, *args) -> list:
    """Run fn(rank, world, *args) in `world` new processes joined over gloo; return each rank's result."""
    port, hold = held_port()
    with tempfile.TemporaryDirectory() as out, hold:
        ctx = _rank_context()
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, fn, args, out, dict(os.environ), os.getcwd()))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        _join(procs, out)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


SPAWN_TIMEOUT_S = float(os.environ.get("ZOFF_TEST_SPAWN_TIMEOUT_S", "900"))


def _join(procs: list, out: str, timeout_s: float | None = None) -> None:
    """Wait for every rank; the first that fails fails the test with its traceback (the others are stopped).
    Ranks still running after `timeout_s` (default SPAWN_TIMEOUT_S: far above any spawn of the suite) are
    stopped and the test fails naming them: a hung collective costs one test, not the whole run."""
    import time

    deadline = time.monotonic() + (SPAWN_TIMEOUT_S if timeout_s is None else timeout_s)
    ranks = dict(enumerate(procs))
    while ranks:
        if time.monotonic() > deadline:
            for q in ranks.values():
                q.kill()
                q.join()
            raise RuntimeError(f"rank(s) {sorted(ranks)} of the spawned job still running after the timeout")
        for r, p in list(ranks.items()):
            if p.exitcode is None:
                continue
            del ranks[r]
            if p.exitcode != 0:
                for q in ranks.values():
                    q.kill()
                    q.join()
                err = Path(out) / f"rank{r}.err"
                why = err.read_text() if err.exists() else f"exit code {p.exitcode}"
                raise RuntimeError(f"rank {r} of the spawned job failed:\n{why}")
        time.sleep(0.01)


class LazyRuns(dict):
    """A module fixture's spawns by world size, each made when a test first asks for it: a world whose tests
    are deselected (world 3 outside `-m grid`) costs nothing."""

    def __init__(self, run: Callable[[int], list]):
        super().__init__()
        self._run = run

    def __missing__(self, world: int) -> list:
        self[world] = self._run(world)
        return self[world]


# World sizes 1 and 2 in the default suite; 3 (uneven shard boundaries, more peers) in `-m grid`, for the
# default suite's time budget.
GRID_WORLD_3 = [1, 2, pytest.param(3, marks=pytest.mark.grid)]


def zoff_rank(
    rank: int, world: int, cfg_dict: dict, run_dir: str | None = None, resume: str | None = None
) -> dict:
    """One rank of a zoff run through the real session, checkpointer and trainer loop; returns what tests compare.

    With `run_dir`, checkpoints go to cfg's checkpoint.dir or <run_dir>/checkpoints and `resume` is honoured.
    """
    cfg = config_from_dict(cfg_dict)
    s = build_session(cfg, rank_device(rank))
    ckpt, start = None, 0
    if run_dir is not None:
        ckpt = Checkpointer(
            s.engine,
            cfg.checkpoint,
            Path(run_dir),
            dump_yaml(cfg),
            cfg.train.max_steps,
            base_reference(cfg.model),
        )
        start, state = ckpt.resume(resume)
        if state is not None:
            s.batches.load_state_dict(state["data"])
    norms = []
    engine_step = s.engine.step

    def step(
        lr: float,
    ):  # the global gradient norm of every step: Adam hides a mis-scaled gradient, this won't
        result = engine_step(lr)
        norms.append(result.grad_norm)
        return result

    s.engine.step = step
    s.ckpt, s.start_step = ckpt, start
    losses = train_loop(s)
    out = {
        "start": start,
        "losses": losses,
        "grad_norms": norms,
        "params": {k: v.cpu() for k, v in s.engine.gathered_params().items()},
        "memory": s.engine.memory_report(),
        "planned": s.engine.planned_memory(),
        "stats": s.engine.stats(),
        "compiled_graphs": _compiled_graphs(),
    }
    s.engine.close()
    return out


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (train.compile's tests); 0 without Dynamo."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def zoff_rank_many(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    """Several runs one after the other in the same ranks: one process start-up for a whole test matrix."""
    return [zoff_rank(rank, world, cfg) for cfg in cfgs]


def run_zoff_many(cfgs: list[dict], world: int) -> list[dict]:
    """Rank 0's result of each config in `cfgs`, all run in one spawn of `world` ranks."""
    return spawn(zoff_rank_many, world, cfgs)[0]


def run_zoff(
    cfg: dict, world: int, run_dir: str | Path | None = None, resume: str | None = None
) -> list[dict]:
    return spawn(zoff_rank, world, cfg, None if run_dir is None else str(run_dir), resume)


def reference_run(
    cfg: Config,
    world: int,
    delay_warmup: int | None = None,
    build: Callable | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Plain single-process PyTorch over the same global batches zoff sees on `world` ranks.

    With `delay_warmup` (DPU), the optimizer updates a separate master copy, and the model the next forward
    uses gets update k only after update k+1 has been computed, for k > delay_warmup: the one-step-stale
    parameters of ZeRO-Offload's delayed parameter update, applied explicitly.
    With `dtype` float64 the model is built as it is (its initial values are the fp32 ones) and then trained
    in float64, tensors its forward creates included: the exact run an fp32 run approximates.
    """
    previous = torch.get_default_dtype()
    try:
        out = _reference_run(cfg, world, delay_warmup, build, dtype)
    finally:
        torch.set_default_dtype(previous)
    return out


def _reference_run(
    cfg: Config, world: int, delay_warmup: int | None, build: Callable | None, dtype: torch.dtype
) -> dict:
    torch.manual_seed(cfg.train.seed)
    device = rank_device(0)
    model = (build or build_model)(cfg.model).to(device)  # `build`: e.g. a peft-wrapped reference
    model = model.to(dtype)
    torch.set_default_dtype(dtype)
    live = model
    if delay_warmup is not None:
        model = copy.deepcopy(live)  # the masters; `live` is what forward/backward sees
    o = cfg.optim
    opt = plain_optimizer(model, o)
    accum = cfg.train.grad_accum if cfg.train.global_batch_size is None else None
    global_batch = cfg.train.global_batch_size or cfg.data.batch_size * accum * world
    batches = GlobalBatches(
        load_corpus(cfg.data, cfg.train.seed), cfg.data.seq_len, global_batch, 1, 0, 1, cfg.train.seed
    )
    losses, norms = [], []
    for step in range(cfg.train.max_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o.lr, cfg.train.max_steps, cfg.schedule)
        opt.zero_grad()
        live.zero_grad()
        x, y = batches.micro_batch_at(step, 0)
        loss = lm_loss(live(x.to(device)), y.to(device))
        loss.backward()
        if live is not model:
            for p, q in zip(model.parameters(), live.parameters()):
                p.grad = q.grad
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        )
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        previous = [p.detach().clone() for p in model.parameters()] if live is not model else None
        opt.step()
        if live is not model:
            stale = step + 1 > delay_warmup and step + 1 < cfg.train.max_steps  # the last update is flushed
            with torch.no_grad():
                for q, p, old in zip(live.parameters(), model.parameters(), previous):
                    q.copy_(old if stale else p)
        losses.append(loss.item())
    params = {
        n: p.detach().cpu().clone()
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.requires_grad
    }
    return {"losses": losses, "params": params, "grad_norms": norms}


def plain_optimizer(model: torch.nn.Module, o) -> torch.optim.Optimizer:
    """torch's AdamW (or Adam) over the trainable parameters, with zoff's weight-decay groups: the reference's."""
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if p.requires_grad and default_decay(n, p)]},
        {"params": [p for n, p in named if p.requires_grad and not default_decay(n, p)], "weight_decay": 0.0},
    ]
    opt_cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return opt_cls(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False)


def assert_close_losses(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: zoff {a!r} vs reference {b!r}"


def assert_close_params(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        err = (got[name] - ref).abs().max().item()
        assert err <= rtol * max(ref.abs().max().item(), 1.0), f"{name}: max abs diff {err}"


# A transformers Llama built from its config alone (no folder): the model section the tests give tiny_cfg.
TINY_LLAMA = {
    "name": "hf:LlamaForCausalLM",
    "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 32,
               "tie_word_embeddings": False},
}  # fmt: skip


def tiny_cfg(**sections) -> dict:
    """The tests' small GPT on synthetic data, with per-section overrides: tiny_cfg(zero={"stage": 2})."""
    base = {
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
        "data": {"name": "synthetic", "seq_len": 16, "batch_size": 2, "synthetic_tokens": 8000},
        "optim": {"lr": 3e-3, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 3},
        "train": {"max_steps": 20, "grad_accum": 2, "grad_clip": 0.5, "log_every": 1, "eval_batches": 1},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return base


# --------------------------------------------------------------------------------- memory of one process


def rss_kib(field: str) -> int:
    """A /proc/self/status field in KiB: VmRSS (now) or VmHWM (the peak since reset_peak_rss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (False where /proc/self/clear_refs is not writable)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def recording_init(model: torch.nn.Module) -> list[str]:
    """Wrap a deferred model's init_parameter; the returned list fills with the names the engine asks for."""
    calls: list[str] = []
    init = model.init_parameter
    model.init_parameter = lambda name, t: (calls.append(name), init(name, t))
    return calls


def assert_built_within_shard(results: list[dict | None], doing: str) -> None:
    """Each rank's peak RSS growth while `doing` (building a model into its engine) stays within its model
    states plus two units, a bound that tells a whole-model copy apart. Results: grew, model_state,
    model_bytes, largest_unit_bytes (None: the peak could not be reset)."""
    import pytest

    for rank, r in enumerate(results):
        if r is None:
            pytest.skip("/proc/self/clear_refs is not writable: no way to reset the peak RSS")
        allowed = r["model_state"] + 2 * r["largest_unit_bytes"] + 32 * 2**20
        assert allowed < r["model_state"] + r["model_bytes"]  # the bound tells a whole-model copy apart
        assert r["grew"] <= allowed, (
            f"rank {rank}: peak RSS grew {r['grew'] / 2**20:.0f} MiB {doing}; its model states "
            f"{r['model_state'] / 2**20:.0f} MiB, two units {2 * r['largest_unit_bytes'] / 2**20:.0f} MiB, "
            f"whole model {r['model_bytes'] / 2**20:.0f} MiB"
        )


def build_measured(model_cfg, threshold: int, extra=None) -> dict | None:
    """Build `model_cfg` into a stage-3 engine (build_for_engine), measuring the peak RSS growth; the result
    assert_built_within_shard takes, plus extra(engine)'s items. None where the peak cannot be reset."""
    from zoff.config import OptimConfig, ZeroConfig
    from zoff.engine import build_engine
    from zoff.models import build_for_engine, builds_sharded

    if not reset_peak_rss():
        return None
    assert builds_sharded(model_cfg)  # imports the model's code before the measurement: Python, not weights
    before = rss_kib("VmRSS")
    reset_peak_rss()
    model = build_for_engine(model_cfg)
    engine = build_engine(model, ZeroConfig(stage=3, param_persistence_threshold=threshold), OptimConfig())
    peak = rss_kib("VmHWM")
    mem = engine.memory_report()
    out = {
        "grew": (peak - before) * 1024,
        "model_state": mem["params"] + mem["grads"] + mem["optimizer_states"],
        "model_bytes": engine.plan.numel * 4,
        "largest_unit_bytes": max(u.padded for u in engine.plan.units) * 4,
        **(extra(engine) if extra else {}),
    }
    engine.close()
    return out
