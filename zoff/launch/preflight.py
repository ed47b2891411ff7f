"""`zoff train`'s pre-flight, before any rank starts: what would otherwise fail inside every rank (the model
factory, the policy, the data, the swap folders, the trackers), train.sequence_parallel against every world
size the launch may have and the model's heads, and a resumed checkpoint, verified whole, with its global batch
against this run's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from zoff.config import Config, data_parallel_size, derive_grad_accum
from zoff.errors import UserError


def _node_counts(cfg: Config) -> range:
    low, _, high = cfg.launch.nnodes.partition(":")
    return range(int(low), int(high or low) + 1)


def check_sequence_parallel(cfg: Config, model: nn.Module) -> None:
    """train.sequence_parallel divides every world size the launch may have (and the global batch divides
    over the data ranks), and the model's heads."""
    from zoff.models.sequence_split import splittable

    n = cfg.train.sequence_parallel
    # (divisibility repeats every n node counts: n of them answer for the whole range)
    for nodes in _node_counts(cfg)[:n]:
        world = cfg.launch.nproc_per_node * nodes
        data_parallel_size(cfg.train, world)
        derive_grad_accum(cfg.train, cfg.data.batch_size, world)
    splittable(model, n)


def check_resumed_batch(cfg: Config, checkpoint: Path) -> None:
    """The checkpoint's global batch is this run's (at the launch's first node count), or one line saying so."""
    from zoff.checkpoint.format import read_manifest
    from zoff.data import check_same_global_batch

    trainer = read_manifest(checkpoint, verify=False).get("trainer")
    data = trainer.get("data") if isinstance(trainer, dict) else None
    saved = data.get("global_batch") if isinstance(data, dict) else None
    if saved is not None and (type(saved) is not int or saved < 1):  # a manifest someone else wrote
        raise UserError(
            f"{checkpoint / 'manifest.json'}: trainer.data.global_batch is {saved!r}, not a count"
        )
    world = cfg.launch.nproc_per_node * _node_counts(cfg)[0]
    accum = derive_grad_accum(cfg.train, cfg.data.batch_size, world)
    check_same_global_batch(saved, cfg.data.batch_size * accum * data_parallel_size(cfg.train, world))


def check_before_launch(cfg: Config) -> nn.Module:
    """Catch what would otherwise fail inside every worker: the model factory, the data files, the swap
    folders. Returns the model as built on the meta device (structure only)."""
    from zoff.data import preflight as preflight_data
    from zoff.engine.policy import Policy
    from zoff.models import build_model, enable_activation_checkpointing
    from zoff.planning.disk_room import check_swap_path
    from zoff.trainer.session import packs

    # an impossible stage/offload combination, named here rather than by every rank's engine
    invalid = None if cfg.zero.auto else Policy.of(cfg.zero).invalid()
    if invalid is not None:
        raise UserError(f"{invalid[0]}: {invalid[1]}")
    with torch.device("meta"):
        model = build_model(cfg.model)
    if cfg.train.sequence_parallel > 1:
        check_sequence_parallel(cfg, model)
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.train.loss_tile:
        from zoff.models.head import output_head
        from zoff.trainer.loss import loss_tiles

        output_head(model)
        verdict = loss_tiles(model)
        if not verdict.ok:
            raise UserError(
                f"train.loss_tile: {type(model).__name__} cannot have its loss tiled: {verdict.why}; "
                "set train.loss_tile: 0"
            )
    preflight_data(cfg.data, pack=cfg.data.format != "text" and packs(cfg, model, warn=True))
    check_swap_path(cfg, model)
    from zoff.trainer.trackers import check_installed

    check_installed(cfg.log)
    if cfg.log.tensorboard:
        try:
            from torch.utils import tensorboard  # noqa: F401
        except ImportError:
            raise UserError(
                "log.tensorboard: needs the tensorboard package (pip install zoff[tensorboard])"
            ) from None
    return model


def check_resume(resume: str, cfg: Config, run_dir: Path | None) -> str | None:
    """Find and fully verify the checkpoint now: a bad one is a one-line error before any rank starts.

    auto: the newest intact checkpoint, every newer one skipped with a line saying why; returns what the
    ranks load (that folder; None: none yet, start fresh)."""
    from zoff.checkpoint.format import find_checkpoint, newest_intact, read_manifest

    if resume == "auto":
        if cfg.checkpoint.dir is None and run_dir is None:
            raise UserError(
                "--resume auto: needs --run-dir (or checkpoint.dir) to know where checkpoints are"
            )
        ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        path, skipped = newest_intact(ckpt_dir, verify=True)
        for line in skipped:
            print(f"zoff: --resume auto: {line}", flush=True)
        if path is None and skipped:
            raise UserError(
                f"--resume auto: no intact checkpoint in {ckpt_dir} ({len(skipped)} skipped, above); "
                "start afresh without --resume, or repair one"
            )
        if path is None:
            print(f"zoff: no checkpoint in {ckpt_dir}: starting fresh", flush=True)
            return None
        print(f"zoff: --resume auto: resuming from {path}", flush=True)
        check_resumed_batch(cfg, path)
        return str(path)
    path = find_checkpoint(resume, Path("."))
    read_manifest(path, verify=True)
    check_resumed_batch(cfg, path)
    return resume
