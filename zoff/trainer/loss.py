"""The loss of one micro-batch, as its share of the step's loss: its gradients add up over micro-batches and
ranks (the engine averages over ranks) to the gradient of the plain-PyTorch loss of the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoff.data.batch import IGNORE, MicroBatch
from zoff.models import lm_loss


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
