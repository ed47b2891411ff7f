"""One rank's training session: `build_session` wires model, engine and data once; run_training (run.py) adds
what a run trains with besides (its metrics writer, checkpointer, start step and stop request), and the fixed
loop (loop.py) takes the whole session."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

import torch

from zoff.checkpoint import Checkpointer
from zoff.config import Config, data_parallel_size, derive_grad_accum
from zoff.data import GlobalBatches, check_vocab, load_corpus
from zoff.engine import Comm, ZeroEngine, build_engine
from zoff.errors import UserError
from zoff.host.kernels import compute_precision, upcasts
from zoff.models import build_for_engine, checks_vocab, enable_activation_checkpointing
from zoff.models.packing import packs_examples
from zoff.models.sequence_split import split_attention
from zoff.models.tiling import tile_mlps
from zoff.models.twin import base_of
from zoff.models.ulysses import SequenceGroup, sequence_group
from zoff.models.upcast import upcast_compute
from zoff.trainer.activation_offload import ActivationOffload
from zoff.trainer.compile import CompiledBlocks, compile_blocks
from zoff.trainer.metrics import MetricsWriter
from zoff.trainer.nonfinite import NonFinite
from zoff.trainer.preempt import StopRequest


@dataclass
class Session:
    """What one rank trains with: the engine, its data stream, its process group, the config as this rank runs
    it (train.precision the one its states are kept in, and under train.cpu_precision=fp32/auto the one it
    computes in; upcast computes in fp32 over them); and, set by run_training, what the loop reports to and saves
    with, where it starts and what asks it to stop (None where a test's loop has none)."""

    engine: ZeroEngine
    batches: GlobalBatches
    comm: Comm
    cfg: Config
    data_description: str
    compiled: CompiledBlocks | None = None  # train.compile's blocks
    # the plan's line on a 16-bit precision's CPU kernels (zoff.host.kernels), or None
    precision_note: str | None = None
    upcast: bool = False  # train.cpu_precision=upcast: fp32 compute over the 16-bit states (models/upcast.py)
    # train.sequence_parallel: the ranks this one shares its sequences with, and what their exchanges cost
    sequence: SequenceGroup = dataclasses.field(default_factory=lambda: SequenceGroup(1, 0))
    # the steps skipped for a non-finite loss or gradient, and when they stop the run (None: they never do)
    nonfinite: NonFinite | None = None
    writer: MetricsWriter | None = None  # rank 0's metrics (None on the other ranks)
    ckpt: Checkpointer | None = None
    start_step: int = 0  # steps already done (a resumed run's)
    stop: StopRequest | None = None
    # train.activation_offload's host copies and their budget (None: the offload is off)
    activation_offload: ActivationOffload | None = None


def build_session(cfg: Config, device: torch.device) -> Session:
    """Model (same initial weights on every rank), engine for the ZeRO policy, this rank's data stream."""
    # the precision this rank computes in: train.cpu_precision may make a 16-bit run fp32 on a CPU rank
    # (upcast: its matmuls only, over the configured 16-bit states)
    precision, precision_note = compute_precision(
        cfg.train.precision, cfg.train.cpu_precision, device.type == "cpu"
    )
    upcast = upcasts(cfg.train.precision, cfg.train.cpu_precision, device.type == "cpu")
    configured = cfg  # (what the plan reads: it applies train.cpu_precision itself)
    if not upcast:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    # (the same-gathers check's gloo group beside NCCL is stage 3's alone: no other stage gathers)
    comm = Comm(timeout_s=cfg.launch.timeout_s, side_checks=None if cfg.zero.stage == 3 else False)
    torch.manual_seed(cfg.train.seed)
    # The builtin GPT and hf: models with safetensors weights are built on the meta device and materialised
    # shard by shard by the engine.
    model = build_for_engine(cfg.model)
    if upcast:
        upcast_compute(model)
    offload = _checkpoint_blocks(model, configured, device)
    if cfg.train.mlp_tile and not tile_mlps(model, cfg.train.mlp_tile):
        raise UserError(
            f"train.mlp_tile: {type(model).__name__} has no MLP to tile (a module named mlp whose class ends in "
            "MLP, or one whose class sets zoff_sequence_wise = True); set the key to 0"
        )
    data_parallel_size(cfg.train, comm.world)  # (one line if train.sequence_parallel does not divide it)
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
    n = cfg.train.sequence_parallel
    batches = stream(
        corpus, cfg.data.seq_len, cfg.data.batch_size, accum, comm.rank, comm.world, cfg.train.seed, n
    )
    # (after the data: whether the model packs is tried on a tiny twin of its unsplit attention)
    sequence = sequence_group(n, cfg.launch.timeout_s)
    if n > 1:
        split_attention(model, sequence)
    torch.manual_seed(cfg.train.seed + 1 + comm.rank)  # dropout differs per rank, reproducibly
    return Session(
        engine,
        batches,
        comm,
        cfg,
        corpus.description,
        compiled,
        precision_note,
        upcast=upcast,
        sequence=sequence,
        nonfinite=NonFinite(cfg.train.max_nonfinite_steps, fp16=cfg.train.precision == "fp16"),
        activation_offload=offload,
    )


def _checkpoint_blocks(model: torch.nn.Module, cfg: Config, device: torch.device) -> ActivationOffload | None:
    """train.activation_checkpointing on the model's blocks; with train.activation_offload, their inputs in
    host memory, the pool's budget the plan's (zoff estimate's) bytes for them."""
    if not cfg.train.activation_checkpointing:
        return None
    offload = None
    if cfg.train.activation_offload:
        from zoff.planning.memory import activation_offload_budget  # (planning: only with the offload)

        offload = ActivationOffload(device, activation_offload_budget(cfg, device.type))
    enable_activation_checkpointing(model, offload.checkpoint if offload else None)
    return offload


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


def _host_reserved(cfg: Config, world: int, device: torch.device) -> int:
    """The rank's host memory besides the disk tier's, as `zoff estimate` computes it: the host budget holds it
    too, so a run's RSS stays within zero.offload_optimizer.host_budget (plus the interpreter)."""
    if cfg.zero.offload_optimizer.device != "nvme":
        return 0
    from zoff.planning.memory import rank_split  # (planning reads the engine; only the disk tier needs it)

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank_split(cfg, world, local, device.type).reserved
