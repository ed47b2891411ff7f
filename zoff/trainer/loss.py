"""The loss of one micro-batch, as its share of the step's loss: its gradients add up over micro-batches and
ranks (the engine averages over ranks) to the gradient of the plain-PyTorch loss of the global batch.

With train.loss_tile the output head and the cross-entropy run a tile of positions at a time, each tile under
activation checkpointing, so no (tokens x vocabulary) logits tensor ever exists: forward keeps only each
tile's scalar, backward recomputes one tile's logits at a time. Same operations, same dtypes: the loss differs
from the untiled one only by the order its per-token terms are summed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zoff.data.batch import IGNORE, MicroBatch
from zoff.models import lm_loss
from zoff.models.head import head_replaced, output_head
from zoff.models.twin import Verdict, cached_verdict, vocab_of
from zoff.models.upcast import is_upcast


def micro_batch_loss(output, batch: MicroBatch, accum: int) -> torch.Tensor:
    """Pretraining: the micro-batch's mean over its tokens, over the accumulation. Fine-tuning: the sum over
    its trained tokens, over batch.loss_divisor (the global batch's trained tokens / world size)."""
    logits = getattr(output, "logits", output)
    if batch.loss_divisor is None:
        return lm_loss(logits, batch.targets.to(logits.device)) / accum
    total = F.cross_entropy(
        logits.float().flatten(0, 1),
        batch.targets.to(logits.device).flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return total / batch.loss_divisor


def forward_loss(
    model: nn.Module, batch: MicroBatch, accum: int, device: torch.device, tile: int = 0
) -> torch.Tensor:
    """The model's forward on the micro-batch and its loss (micro_batch_loss's), tiled when `tile` > 0."""
    inputs, kwargs = batch.inputs.to(device), batch.model_kwargs(device)
    if tile <= 0:
        return micro_batch_loss(model(inputs, **kwargs), batch, accum)
    head = output_head(model)
    targets = batch.targets.to(device).flatten()
    # The loss is computed where the head would run, inside the model's forward: at stage 3 that is where its
    # weight is gathered (an evaluation releases it when the forward returns).
    with head_replaced(model, head, TiledLossHead(head, targets, tile)):
        out = model(inputs, **kwargs)
    total = getattr(out, "logits", out)
    if batch.loss_divisor is None:
        return total / targets.numel() / accum
    return total / batch.loss_divisor


class TiledLossHead(nn.Module):
    """Stands in for the output head during a tiled forward: given the final hidden states, returns the summed
    cross-entropy against `targets` (a 0-dim tensor the model passes on as its logits)."""

    def __init__(self, head: nn.Linear, targets: torch.Tensor, tile: int):
        super().__init__()
        object.__setattr__(self, "_head", head)  # not a submodule: its parameters stay the head's alone
        self.targets, self.tile = targets, tile

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return tiled_cross_entropy(hidden.flatten(0, -2), self._head, self.targets, self.tile)


def tiled_cross_entropy(
    hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, tile: int
) -> torch.Tensor:
    """sum over positions of cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE), `tile`
    positions at a time; each tile's logits are recomputed in backward rather than kept."""
    total = hidden.new_zeros((), dtype=torch.float32)
    weight, bias = head.weight, head.bias
    if is_upcast(head):  # train.cpu_precision=upcast: fp32 products over a 16-bit head, whatever the model
        # hands it. One fp32 copy for every tile (held until the head's backward, which comes next), so the
        # weight's gradient sums over the tiles in fp32 and rounds to 16 bits once, as the untiled head's does.
        hidden, weight, bias = hidden.float(), weight.float(), None if bias is None else bias.float()
    for start in range(0, hidden.shape[0], tile):
        h, t = hidden[start : start + tile], targets[start : start + tile]
        if torch.is_grad_enabled():
            part = checkpoint(_tile_loss, h, t, weight, bias, use_reentrant=False)
        else:
            part = _tile_loss(h, t, weight, bias)
        total = total + part
    return total


def _tile_loss(
    h: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight, bias).float(), t, ignore_index=IGNORE, reduction="sum")


def loss_tiles(model: nn.Module) -> Verdict:
    """Whether the tiled loss equals the untiled one for this model: tried on a tiny twin of it at batch 2
    (cached). A model that changes its logits after the head (Gemma-2's soft-cap, Granite's scale) or reshapes
    them would train on wrong numbers with the head's output replaced by the loss."""
    return cached_verdict("tiled-loss", model, _try_tiles)


@torch.no_grad()
def _try_tiles(model: nn.Module) -> Verdict:
    model.eval()
    try:
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, vocab_of(model), (2, 6), generator=g) for _ in range(2))
        batch = MicroBatch(x, y)
        whole = forward_loss(model, batch, 1, torch.device("cpu"), 0)
        tiled = forward_loss(model, batch, 1, torch.device("cpu"), 5)
    except Exception as e:  # noqa: BLE001 - a model that cannot run with its head replaced cannot tile
        return Verdict(False, f"it does not run with its head replaced ({type(e).__name__}: {str(e)[:120]})")
    if tiled.shape != whole.shape or not torch.allclose(tiled, whole, rtol=1e-5, atol=1e-6):
        return Verdict(False, "its logits are changed after the output head (a soft-cap or a scale)")
    return Verdict(True, "")
