"""train.sequence_parallel N in the estimate (zoff/models/ulysses.py): whether N ranks can share each sequence
of a model on a world, in one line where they cannot, and which N can (for --suggest and `zero: auto`).

A rank's bytes at N are memory.estimate()'s with the configured N: the activations of seq / N tokens and the
all-to-all's buffers (activations.ulysses_terms), the model states of the whole world (ZeRO partitions over
every rank whatever N), and the global batch's micro-batches over the world / N data-parallel ranks.
"""

from __future__ import annotations

from torch import nn

from zoff.errors import UserError
from zoff.models.sequence_split import splittable
from zoff.models.ulysses import KEY


def refusal(model: nn.Module, seq_len: int, n: int, gpus_per_node: int, nodes: int) -> str | None:
    """None where N ranks can share each sequence of `model` (a meta model of it) on gpus_per_node x nodes,
    else the one line that says why not: N divides the world, data.seq_len and the heads (key/value heads:
    or N divides them), and the model is one the exchange splits."""
    if n == 1:
        return None
    world = gpus_per_node * nodes
    if world % n:
        return (
            f"{KEY}: {n} does not divide the world size {world} ({gpus_per_node} GPU(s) per node x {nodes} "
            f"node(s); each group of {n} ranks trains the same sequences)"
        )
    if seq_len % n:
        return f"{KEY}: {n} does not divide data.seq_len {seq_len} (each rank holds seq_len / N tokens)"
    try:
        splittable(model, n)
    except UserError as e:
        return str(e)
    return None


def check(model: nn.Module, seq_len: int, n: int, gpus_per_node: int, nodes: int) -> None:
    """refusal()'s line as a UserError (exit 2), or nothing."""
    why = refusal(model, seq_len, n, gpus_per_node, nodes)
    if why:
        raise UserError(why)


def choices(model: nn.Module, seq_len: int, above: int, gpus_per_node: int, nodes: int) -> list[int]:
    """The N larger than `above` that split `model` on this world, smallest first. Only multiples of `above`:
    a config without train.global_batch_size keeps its global batch by accumulating N / above times as many
    micro-batches (with_sequence_parallel)."""
    world = gpus_per_node * nodes
    return [
        n
        for n in range(2 * above, world + 1, above)
        if refusal(model, seq_len, n, gpus_per_node, nodes) is None
    ]
