"""Pre-flight checks of a run's shape, before any rank starts: train.sequence_parallel against every world size
the launch may have and the model's heads, and a resumed checkpoint's global batch against this run's."""

from __future__ import annotations

from pathlib import Path

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
