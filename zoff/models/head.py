"""The output head, for the tiled loss (train.loss_tile): which module it is, the model run without it (its
output is then the final hidden states), and whether that is all the head does.

A model whose logits are changed after the head (Gemma-2's final soft-capping, a logit scale) would train on
wrong numbers if the loss applied the bare head, so that is tried rather than assumed: on a tiny twin of the
model's class (twin.py), logits must equal the head applied to the headless output; the verdict is cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from zoff.errors import UserError
from zoff.models.twin import Verdict, cached_verdict, output_tensor, vocab_of


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


def head_is_last(model: nn.Module) -> Verdict:
    """Whether the logits are the head applied to the headless output, tried on a tiny twin (cached)."""
    return cached_verdict("head", model, _try)


@torch.no_grad()
def _try(model: nn.Module) -> Verdict:
    model.eval()
    x = torch.randint(0, vocab_of(model), (1, 6), generator=torch.Generator().manual_seed(0))
    try:
        logits = output_tensor(model(x))
        head = output_head(model)
        with head_replaced(model, head, nn.Identity()):
            hidden = output_tensor(model(x))
        again = head(hidden)
    except Exception as e:  # noqa: BLE001 - a model that cannot run headless cannot tile its loss
        return Verdict(False, f"it does not run without its head ({type(e).__name__}: {str(e)[:120]})")
    if again.shape != logits.shape or not torch.allclose(again, logits, rtol=1e-5, atol=1e-6):
        return Verdict(False, "its logits are changed after the output head (a soft-cap or a scale)")
    return Verdict(True, "")
