"""One rank's training session: `build_session` wires model, engine and data once; `run_training` resumes,
prints the plan and hands everything to the fixed loop (loop.py)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from zoff.engine.activation_offload import ActivationOffload

from zoff.checkpoint import Checkpointer
from zoff.checkpoint.base_ref import base_reference
from zoff.config import Config, derive_grad_accum, dump_yaml
from zoff.data import GlobalBatches, check_vocab, load_corpus
from zoff.engine import Comm, ZeroEngine, build_engine
from zoff.engine.disk.traffic import held_write_back_bytes
from zoff.engine.footprint import data_parallel_bytes
from zoff.errors import UserError
from zoff.models import (
    build_for_engine,
    checks_vocab,
    enable_activation_checkpointing,
    model_flops_per_token,
)
from zoff.models.packing import packs_examples
from zoff.models.tiling import tile_mlps
from zoff.models.twin import base_of
from zoff.trainer.compile import CompiledBlocks, compile_blocks, compile_seconds
from zoff.trainer.loop import train_loop
from zoff.trainer.metrics import MetricsWriter, peak_rss_slots, rank_logger
from zoff.trainer.preempt import STOP
from zoff.trainer.trackers import Trackers


@dataclass
class Session:
    """What one rank trains with: the engine, its data stream, its process group."""

    engine: ZeroEngine
    batches: GlobalBatches
    comm: Comm
    data_description: str
    compiled: CompiledBlocks | None = None  # train.compile's blocks


def build_session(cfg: Config, device: torch.device) -> Session:
    """Model (same initial weights on every rank), engine for the ZeRO policy, this rank's data stream."""
    # (the same-gathers check's gloo group beside NCCL is stage 3's alone: no other stage gathers)
    comm = Comm(timeout_s=cfg.launch.timeout_s, side_checks=None if cfg.zero.stage == 3 else False)
    torch.manual_seed(cfg.train.seed)
    # The builtin GPT and hf: models with safetensors weights are built on the meta device and materialised
    # shard by shard by the engine.
    model = build_for_engine(cfg.model)
    if cfg.train.activation_checkpointing:
        offload = ActivationOffload(device) if cfg.train.activation_offload else None
        enable_activation_checkpointing(model, offload.checkpoint if offload else None)
    if cfg.train.mlp_tile and not tile_mlps(model, cfg.train.mlp_tile):
        raise UserError(
            f"train.mlp_tile: {type(model).__name__} has no MLP to tile (a module named mlp whose class ends in "
            "MLP, or one whose class sets zoff_sequence_wise = True); set the key to 0"
        )
    accum = derive_grad_accum(cfg.train, cfg.data.batch_size, comm.world)
    engine = build_engine(
        model,
        cfg.zero,
        cfg.optim,
        precision=cfg.train.precision,
        grad_clip=cfg.train.grad_clip,
        grad_accum=accum,
        device=device,
        comm=comm,
        host_reserved=_host_reserved(cfg, comm.world, device),
    )
    compiled = None
    if (
        cfg.train.compile
    ):  # after the engine: its hooks are on the blocks' (eager) __call__, around the forward
        compiled = compile_blocks(engine.model, cfg.zero.block_classes, cfg.train.compile_backend)
    if cfg.data.format == "text":
        corpus, stream = load_corpus(cfg.data, cfg.train.seed), GlobalBatches
    else:  # fine-tuning examples, packed where the model attends within each example only
        from zoff.data.sft import SFTBatches, load_sft_corpus

        corpus, stream = load_sft_corpus(cfg.data, cfg.train.seed, pack=packs(cfg, model)), SFTBatches
    if checks_vocab(cfg.model):
        check_vocab(corpus, cfg.model.vocab_size)
    batches = stream(
        corpus, cfg.data.seq_len, cfg.data.batch_size, accum, comm.rank, comm.world, cfg.train.seed
    )
    torch.manual_seed(cfg.train.seed + 1 + comm.rank)  # dropout differs per rank, reproducibly
    return Session(engine, batches, comm, corpus.description, compiled)


def packs(cfg: Config, model: torch.nn.Module, warn: bool = False) -> bool:
    """Whether fine-tuning examples share sequences: data.packing, where the model keeps them apart (tried on
    a tiny twin of it: models/packing.py). `warn`: say once why auto trains unpacked (the CLI's pre-flight)."""
    if cfg.data.packing == "never":
        return False
    verdict = packs_examples(model)
    name = type(base_of(model)).__name__
    if cfg.data.packing == "always" and not verdict.ok:
        raise UserError(
            f"data.packing: always, but {name} does not keep packed examples apart ({verdict.why}); "
            "use data.packing: auto or never"
        )
    if warn and not verdict.ok:
        warnings.warn(
            f"data.packing: auto trains {name} one example per row: {verdict.why}",
            stacklevel=2,
        )
    return verdict.ok


def run_training(cfg: Config, run_dir: Path, device: torch.device, resume: str | None = None) -> dict | None:
    """Build this rank's session, resume if asked, print the plan on rank 0, and train."""
    stop = STOP.install()
    s = build_session(cfg, device)
    log = rank_logger(run_dir, s.comm.rank)
    ckpt = Checkpointer(
        s.engine, cfg.checkpoint, run_dir, dump_yaml(cfg), cfg.train.max_steps, base_reference(cfg.model)
    )
    start, state = ckpt.resume(resume)
    if state is not None:
        s.batches.load_state_dict(state["data"])
        log.info("resumed from step %d of %s", start, ckpt.dir)
    plan = _plan_lines(s.engine, s.batches, s.data_description, torch.get_num_threads())
    if s.compiled is not None:
        plan.append("  " + s.compiled.describe())
    for line in plan:
        log.info(line)
    writer = None
    if s.comm.rank == 0:
        print("\n".join(plan), flush=True)
        memory = {f"{k}_mib": v / 2**20 for k, v in s.engine.memory_report().items()}
        trackers = (
            Trackers(cfg.log, run_dir, cfg.to_dict(), memory) if cfg.log.wandb or cfg.log.mlflow else None
        )
        writer = MetricsWriter(
            run_dir, cfg.train.max_steps, start, cfg.log.progress, log, tensorboard=cfg.log.tensorboard,
            flops_per_token=model_flops_per_token(s.engine.model, cfg.model, cfg.data.seq_len),
            precision=cfg.train.precision, device=device, trackers=trackers,
        )  # fmt: skip
        if state is not None:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            writer.event("resume", start, checkpoint=str(ckpt.dir), restart=restart, world_size=s.comm.world)
    try:
        train_loop(
            s.engine, s.batches, cfg.train, cfg.schedule, cfg.optim.lr, writer, s.comm, ckpt, start, stop
        )
        peaks = ranks_peak_rss_mib(s.comm)  # (a collective: every rank, before the engine closes)
    except BaseException:
        if writer is not None and writer.trackers is not None:
            writer.trackers.close()  # the tracker runs end marked failed, not left running
        raise
    finally:
        s.engine.close()  # the disk tier's swap files go with a clean exit (and with an error)
    log.info("engine stats %s", json.dumps(s.engine.stats()))
    log.info("memory report %s", json.dumps(s.engine.memory_report()))
    held, ddp = model_state_bytes(s.engine)
    mib = {"model_state_mib_per_rank": held / 2**20, "ddp_model_state_mib_per_rank": ddp / 2**20}
    # the summary's peak RSS is the largest rank's (rank 0's alone hid a rank that held more: the per-step
    # records still carry rank 0's), each rank's beside it
    mib |= {"peak_rss_mib": max(peaks), "peak_rss_mib_per_rank": peaks}
    if s.compiled is not None:  # rank 0's compile time (every rank compiles its own, at about the same time)
        mib["compile_s"] = compile_seconds()
        log.info("train.compile: %.1f s compiling (forward and backward graphs)", mib["compile_s"])
    return writer.close(mib) if writer is not None else None


def ranks_peak_rss_mib(comm: Comm) -> list[float]:
    """Every rank's peak RSS so far, MiB, in rank order (one all-reduce of a vector, each rank's own slot)."""
    return comm.sum_scalars(peak_rss_slots(comm.rank, comm.world))


def _plan_lines(engine: ZeroEngine, batches: GlobalBatches, data_desc: str, threads: int) -> list[str]:
    mem = engine.memory_report()
    gib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    plan = engine.plan
    shard = plan.shard_numel()
    return [
        f"zoff plan: world size {engine.comm.world} ({engine.comm.backend}), ZeRO stage {engine.stage}, "
        f"{torch.get_default_dtype() if engine.dtype is None else engine.dtype} compute, "
        f"{threads} thread(s) per rank",
        f"  params {plan.numel:,} trainable in {len(plan.units)} unit(s){_frozen_text(engine)}; this rank's "
        f"shard {shard:,} elements",
        f"  model-state memory per rank: params {gib(mem['params'])}, grads {gib(mem['grads'])}, "
        f"optimizer {gib(mem['optimizer_states'])}",
        _vs_data_parallel(engine),
        *_unplanned(engine),
        *(
            [
                f"  host memory per rank (offload): params {gib(mem['cpu_params'])}, grads {gib(mem['cpu_grads'])}, "
                f"optimizer {gib(mem['cpu_optimizer_states'])}, staging {gib(mem['cpu_staging'])}"
                f"{_held_text(engine, gib)}; "
                f"page-locked {gib(engine.pinned_bytes())}" + _disk_text(mem, gib)
            ]
            if engine.offload
            else []
        ),
        *([f"  disk tier: {engine.split.describe()}"] if engine.policy.offload_optimizer == "nvme" else []),
        f"  batch: {batches.micro_batch} x {batches.grad_accum} accum x {engine.comm.world} ranks = "
        f"{batches.global_batch} sequences of {batches.seq_len} tokens; data: {data_desc}",
    ] + _stage3_line(plan, engine.zero.block_classes)


def _held_text(engine: ZeroEngine, gib) -> str:
    """The overlapped or delayed step's parameter write-backs: host buffers taken as the step runs, not at
    start-up (the estimate counts them in staging; the plan's staging figure is what is allocated now)."""
    held = held_write_back_bytes(engine.plan, engine.policy, engine.zero, engine.precision, engine.split)
    which = "delayed" if engine.zero.offload_optimizer.delay_update else "overlapped"
    return f" (+ up to {gib(held)} of held write-backs while the {which} step runs)" if held else ""


def _frozen_text(engine: ZeroEngine) -> str:
    """The frozen parameters (a LoRA base, frozen layers) beside the trainable count, and the adapters' kind."""
    distinct = {id(p): p for p in engine.model.parameters() if not p.requires_grad}
    frozen = sum(p.numel() for p in distinct.values())
    lora = getattr(engine.model, "zoff_lora_config", None)
    adapters = f" (LoRA r {lora.r} on {', '.join(sorted(lora.target_modules))})" if lora is not None else ""
    return f"{adapters}, {frozen:,} frozen" if frozen else adapters


def _disk_text(mem: dict[str, int], fmt) -> str:
    parts = [
        f"{fmt(mem[k])} of {what}"
        for k, what in (
            ("disk_optimizer_states", "optimizer states"),
            ("disk_params", "parameter shards"),
            ("disk_grads", "gradient shards"),
        )  # fmt: skip
        if mem.get(k)
    ]
    return f"; disk {' and '.join(parts)}" if parts else ""


def _host_reserved(cfg: Config, world: int, device: torch.device) -> int:
    """The rank's host memory besides the disk tier's, as `zoff estimate` computes it: the host budget holds it
    too, so a run's RSS stays within zero.offload_optimizer.host_budget (plus the interpreter)."""
    if cfg.zero.offload_optimizer.device != "nvme":
        return 0
    from zoff.planning.memory import rank_split  # (planning reads the engine; only the disk tier needs it)

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank_split(cfg, world, local, device.type).reserved


def model_state_bytes(engine: ZeroEngine) -> tuple[int, int]:
    """(this rank's device model-state bytes as allocated, what plain data parallelism would hold)."""
    mem = engine.memory_report()
    held = mem["params"] + mem["grads"] + mem["optimizer_states"] + mem["frozen_params"]
    return held, data_parallel_bytes(engine.plan.numel) + mem["frozen_params"]


def _vs_data_parallel(engine: ZeroEngine) -> str:
    held, ddp = model_state_bytes(engine)
    return (
        f"  = {held / 2**20:,.1f} MiB of model states on this rank's device (allocated), against "
        f"{ddp / 2**20:,.1f} MiB under plain data parallelism (DDP, 16 B/param): {ddp / max(held, 1):.1f}x less"
    )


def _unplanned(engine: ZeroEngine) -> list[str]:
    """A warning line where what the engine allocated differs from what the policy table (and so `zoff
    estimate`) predicts; tests/unit/test_planned_memory.py holds them equal for every policy."""
    mem, planned = engine.memory_report(), engine.planned_memory()
    mem = {**mem, "params": mem["params"] + mem["frozen_params"]}
    off = [f"{k} {mem[k]:,} allocated vs {v:,} planned" for k, v in planned.items() if mem.get(k, 0) != v]
    return [f"  warning: model states differ from the estimate: {'; '.join(off)}"] if off else []


def _stage3_line(plan, block_classes: list[str]) -> list[str]:
    """What stage 3 gathers at once: a model without repeated blocks is gathered whole (the root unit)."""
    blocks: dict[str, int] = {}
    for u in plan.all_units:
        if not u.persistent and u.modules:
            blocks[u.modules[0]] = blocks.get(u.modules[0], 0) + u.numel
    if not blocks:
        return []
    root = blocks.pop("", 0)
    largest = max(blocks.values(), default=0)
    chosen = f" (zero.block_classes: {', '.join(block_classes)})" if block_classes else ""
    if not blocks:
        return [f"  stage 3 gathers the whole model as one unit of {root:,} params{chosen}"]
    return [
        f"  stage 3 gathers {len(blocks)} block(s) one at a time (largest {largest:,} params) and a root "
        f"unit of {root:,} params kept from forward to the end of backward"
        + (f"; blocks follow zero.block_classes: {', '.join(block_classes)}" if block_classes else "")
    ]
