"""Datasets and the global-batch sampler.

The sample order is a pure function of (seed, step) for the *global* batch, and rank r takes its contiguous
slice. So a run is reproducible, resumes mid-epoch from the step alone, and the same global batch split over
a different number of ranks sees exactly the same samples (elastic restarts depend on this).
"""

from __future__ import annotations

import glob
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from zoff.config import DataConfig
from zoff.errors import UserError

VOCAB_BYTES = 256


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # 1-D uint8/int64 token ids
    val: torch.Tensor
    description: str


def load_corpus(cfg: DataConfig, seed: int) -> Corpus:
    if cfg.name == "stdlib-source":
        return _split_files(_stdlib_files(), cfg, "the Python standard library's .py sources")
    if cfg.name == "text":
        return _split_files(_expand(cfg.paths), cfg, f"{len(cfg.paths)} text path(s)")
    return _synthetic(cfg, seed)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "idlelib", "dist-packages"}
    return sorted(f for f in root.rglob("*.py") if not skip.intersection(f.relative_to(root).parts))


def _expand(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat, recursive=True))
        if not hits:
            raise UserError(f"data.paths: '{pat}' matches no file")
        files.extend(Path(h) for h in hits if Path(h).is_file())
    return files


def _split_files(files: list[Path], cfg: DataConfig, what: str) -> Corpus:
    """Every k-th file goes to validation, so both splits sample the whole corpus, not its alphabetical tail."""
    if not files:
        raise UserError(f"data: {what} gave no files")
    k = max(2, round(1 / cfg.val_fraction)) if cfg.val_fraction > 0 else 0
    train, val, size = bytearray(), bytearray(), 0
    for i, f in enumerate(files):
        data = f.read_bytes()
        if cfg.max_bytes and size + len(data) > cfg.max_bytes:
            data = data[: cfg.max_bytes - size]
        size += len(data)
        (val if k and i % k == k - 1 else train).extend(data)
        if cfg.max_bytes and size >= cfg.max_bytes:
            break
    if len(files) == 1 or not val:  # one file: its tail is the validation split
        cut = int(len(train) * (1 - cfg.val_fraction))
        train, val = train[:cut], train[cut:] + val
    need = cfg.seq_len + 1
    if len(train) < need or len(val) < need:
        raise UserError(
            f"data: {what} hold too little text for data.seq_len {cfg.seq_len} ({len(train)} bytes)"
        )
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), f"{what}: {len(train):,} train / {len(val):,} val bytes")


def _synthetic(cfg: DataConfig, seed: int) -> Corpus:
    """A random Markov chain over bytes: learnable (the loss falls) and generated, not downloaded."""
    g = torch.Generator().manual_seed(10_000 + seed)
    nxt = torch.randint(0, VOCAB_BYTES, (VOCAB_BYTES, 4), generator=g)
    n = cfg.synthetic_tokens
    choice = torch.randint(0, 4, (n,), generator=g)
    toks = torch.empty(n, dtype=torch.long)
    toks[0] = 0
    for i in range(1, n):  # a python loop over 2e5 items costs ~0.2 s, once
        toks[i] = nxt[toks[i - 1], choice[i]]
    cut = int(n * (1 - cfg.val_fraction)) if cfg.val_fraction > 0 else n - cfg.seq_len - 1
    return Corpus(
        toks[:cut].to(torch.uint8), toks[cut:].to(torch.uint8), f"synthetic Markov bytes: {n:,} tokens"
    )


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
    ):
        self.corpus, self.seq_len, self.micro_batch = corpus, seq_len, micro_batch
        self.grad_accum, self.rank, self.world, self.seed = grad_accum, rank, world, seed
        self.global_batch = micro_batch * grad_accum * world
        self.num_windows = (len(corpus.train) - 1) // seq_len  # non-overlapping windows make one epoch
        self._perm_epoch, self._perm = -1, torch.empty(0)

    def micro_batch_at(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of micro-batch `micro` of this rank at training step `step` (0-based)."""
        first = (
            step * self.global_batch
            + self.rank * self.micro_batch * self.grad_accum
            + micro * self.micro_batch
        )
        windows = torch.stack([self._window(i) for i in range(first, first + self.micro_batch)])
        return self._xy(self.corpus.train, windows)

    def val_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first n global batches of the val split (fixed, unshuffled): this rank's micro-batches of each.

        Defined on the global batch, like training, so val_loss does not depend on the number of ranks.
        """
        n_val = max((len(self.corpus.val) - 1) // self.seq_len, 1)
        per_rank = self.micro_batch * self.grad_accum
        out = []
        for b in range(n_batches):
            first = b * self.global_batch + self.rank * per_rank
            for m in range(self.grad_accum):
                idx = torch.arange(first + m * self.micro_batch, first + (m + 1) * self.micro_batch) % n_val
                out.append(self._xy(self.corpus.val, idx * self.seq_len))
        return out

    def _window(self, sample: int) -> torch.Tensor:
        epoch, pos = divmod(sample, self.num_windows)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_windows, generator=g), epoch
        return self._perm[pos] * self.seq_len

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
