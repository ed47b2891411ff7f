"""A corpus as token streams, and the global-batch sampler over it (GlobalBatches): the order is a pure function
of (seed, step) for the global batch, and data rank r takes its contiguous slice. Under train.sequence_parallel
N, ranks [r*N, (r+1)*N) are data rank r and each takes its shard of every sequence of the slice: each rank's mean
loss over its tokens then averages over the world to the global batch's (the shards are equal)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoff.data.batch import MicroBatch
from zoff.errors import UserError

VOCAB_BYTES = 256


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # 1-D uint8/int32/int64 token ids
    val: torch.Tensor
    description: str
    vocab_size: int = VOCAB_BYTES  # the tokenizer's: every id is below it
    eos_id: int | None = None


class GlobalBatches:
    """Serves this rank's micro-batches of the global batch of each step, in the order (seed, step) fixes."""

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        micro_batch: int,
        grad_accum: int,
        rank: int,
        world: int,
        seed: int,
        sequence_parallel: int = 1,
    ):
        self.corpus, self.seq_len, self.micro_batch = corpus, seq_len, micro_batch
        self.grad_accum, self.rank, self.world, self.seed = grad_accum, rank, world, seed
        # the ranks that share sequences (train.sequence_parallel) read one slice, each its shard of it
        self.shards, self.shard = sequence_parallel, rank % sequence_parallel
        self.data_rank, self.data_world = rank // sequence_parallel, world // sequence_parallel
        self.global_batch = micro_batch * grad_accum * self.data_world  # sequences
        self.num_windows = (len(corpus.train) - 1) // seq_len  # non-overlapping windows make one epoch
        self._perm_epoch, self._perm = -1, torch.empty(0)

    def micro_batch_at(self, step: int, micro: int) -> MicroBatch:
        """Inputs and targets of micro-batch `micro` of this rank at training step `step` (0-based)."""
        first = (
            step * self.global_batch
            + self.data_rank * self.micro_batch * self.grad_accum
            + micro * self.micro_batch
        )
        windows = (
            torch.stack([self.window_index(i) for i in range(first, first + self.micro_batch)]) * self.seq_len
        )
        return MicroBatch(*self._xy(self.corpus.train, windows)).shard(self.shard, self.shards)

    def val_batches(self, n_batches: int) -> list[MicroBatch]:
        """The first n global batches of the val split (fixed, unshuffled): this rank's micro-batches of each.

        Defined on the global batch, like training, so val_loss does not depend on the number of ranks.
        """
        n_val = max((len(self.corpus.val) - 1) // self.seq_len, 1)
        per_rank = self.micro_batch * self.grad_accum
        out = []
        for b in range(n_batches):
            first = b * self.global_batch + self.data_rank * per_rank
            for m in range(self.grad_accum):
                idx = torch.arange(first + m * self.micro_batch, first + (m + 1) * self.micro_batch) % n_val
                batch = MicroBatch(*self._xy(self.corpus.val, idx * self.seq_len))
                out.append(batch.shard(self.shard, self.shards))
        return out

    def window_index(self, sample: int) -> torch.Tensor:
        """Which window global sample `sample` (0-based, over all steps) trains on: the data order, one
        permutation of the windows per epoch, fixed by the seed alone (so by no world size or micro-batch)."""
        epoch, pos = divmod(sample, self.num_windows)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_windows, generator=g), epoch
        return self._perm[pos]

    def _xy(self, tokens: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts.view(-1, 1) + torch.arange(self.seq_len + 1).view(1, -1)
        chunk = tokens[idx].long()
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict:
        # The position is the step itself; these fields let a resume check that the data is the same stream.
        return {"seed": self.seed, "global_batch": self.global_batch, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_windows") != self.num_windows or state.get("seed") != self.seed:
            raise UserError(f"checkpoint: data stream differs (saved {state}, now {self.state_dict()})")
        check_same_global_batch(state.get("global_batch"), self.global_batch)


def check_same_global_batch(saved: int | None, now: int) -> None:
    """A resumed run's place in the data is its step times the global batch: another global batch would skip or
    repeat samples, so it is refused (a world size or train.sequence_parallel that changes it, with
    train.grad_accum rather than train.global_batch_size set)."""
    if saved is not None and saved != now:
        raise UserError(
            f"checkpoint: saved at a global batch of {saved} sequences, this run's is {now} (its place in the data "
            f"would skip or repeat samples); set train.global_batch_size: {saved}"
        )
