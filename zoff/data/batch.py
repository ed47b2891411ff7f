"""What the trainer loop gets from a data stream: one micro-batch of inputs and targets, and what its summed
loss is divided by (trainer/loss.py), so that every data format gives the plain-PyTorch loss of the global
batch at any world size, micro-batch and accumulation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # a target that is not in the loss (a prompt token, padding): torch's ignore_index


@dataclass(frozen=True)
class MicroBatch:
    inputs: torch.Tensor  # (batch, seq) token ids
    targets: torch.Tensor  # (batch, seq) next-token ids; IGNORE where no loss is taken
    # Packed examples: each token's position in its own example (restarting at 0), which also tells the
    # model where one example ends (per-example attention). None: one sequence per row, positions 0..seq-1.
    position_ids: torch.Tensor | None = None
    # Fine-tuning data: the loss is summed over this micro-batch's trained tokens and divided by this, the
    # trained tokens of the whole global batch over the world size (the engine averages gradients over
    # ranks), so the step's loss is the mean over the global batch's trained tokens, however it is split.
    # None: every token is trained and the loss is the micro-batch's mean over the accumulation.
    loss_divisor: float | None = None

    def __iter__(self):  # `x, y = batch`: the inputs and targets, as the pretraining stream always gave
        return iter((self.inputs, self.targets))

    def shard(self, index: int, n: int) -> MicroBatch:
        """Shard `index` of `n` of every sequence (train.sequence_parallel): its tokens and targets, and their
        positions in the whole sequence (the model's own, or 0..seq_len-1), which the attention's mask is built
        from. The loss divisor stays the global batch's."""
        if n == 1:
            return self
        rows, t = self.inputs.shape
        a, b = index * t // n, (index + 1) * t // n
        pos = self.position_ids if self.position_ids is not None else torch.arange(t).expand(rows, t)
        return MicroBatch(
            self.inputs[:, a:b], self.targets[:, a:b], pos[:, a:b].contiguous(), self.loss_divisor
        )

    def model_kwargs(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {} if self.position_ids is None else {"position_ids": self.position_ids.to(device)}
