"""The output head, for the tiled loss (train.loss_tile): which module it is, and the model run with
something else in its place (trainer/loss.py puts the tiled cross-entropy there)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from zoff.errors import UserError


def output_head(model: nn.Module) -> nn.Linear:
    """The model's output head: transformers' get_output_embeddings() (through a peft wrapper too), else an
    `lm_head` attribute (the builtin GPT)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise UserError(
            f"train.loss_tile: {type(model).__name__} has no nn.Linear output head (get_output_embeddings() or "
            "lm_head) to tile the loss over; set train.loss_tile: 0"
        )
    return head


@contextmanager
def head_replaced(model: nn.Module, head: nn.Module, replacement: nn.Module) -> Iterator[None]:
    """Run `model` with `replacement` where its head is (an identity: the output is the final hidden states;
    the tiled loss: the output is the loss). The head's parameters stay where they are, so the engine's gathers
    (the root units, held for the model's forward and, in training, its backward) still hold them."""
    where = [(name, m) for name, m in model.named_modules() if m is head]
    if not where:
        raise UserError(f"train.loss_tile: the output head is not a submodule of {type(model).__name__}")
    owners = []
    for name, _ in where:
        parent_name, _, attr = name.rpartition(".")
        owners.append((model.get_submodule(parent_name), attr))
    for parent, attr in owners:
        setattr(parent, attr, replacement)
    try:
        yield
    finally:
        for parent, attr in owners:
            setattr(parent, attr, head)
