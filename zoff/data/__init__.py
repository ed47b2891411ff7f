"""Datasets and the global-batch sampler.

Documents come from the Python standard library, text files, JSON lines, Parquet files or a `datasets` spec on
local files; they are tokenized once per machine into a cached token stream (zoff.data.tokenize) with an
end-of-document token after each, and every k-th document goes to the validation split.

The sample order is a pure function of (seed, step) for the *global* batch, and rank r takes its contiguous
slice. So a run is reproducible, resumes mid-epoch from the step alone, and the same global batch split over
a different number of ranks sees exactly the same samples (elastic restarts depend on this).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from zoff.config import DataConfig
from zoff.data.corpus import VOCAB_BYTES, Corpus, GlobalBatches, check_same_global_batch
from zoff.data.sources import capped, documents, file_stat, source_files, split_documents
from zoff.data.tokenize import cache_key, cache_root, cached_corpus, load_tokenizer
from zoff.errors import UserError

__all__ = [
    "VOCAB_BYTES",
    "Corpus",
    "GlobalBatches",
    "check_same_global_batch",
    "check_vocab",
    "load_corpus",
    "preflight",
]


def load_corpus(cfg: DataConfig, seed: int) -> Corpus:
    need = cfg.seq_len + 1  # one window of each split (the final evaluation reads the val split too)
    if cfg.name == "synthetic":
        _check_synthetic_size(cfg)
        return _synthetic(cfg, seed)
    tok = load_tokenizer(cfg.tokenizer, cfg.tokenizer_revision)
    files, what = source_files(cfg)
    parts = {
        "source": cfg.name, "files": [file_stat(f) for f in files], "text_field": cfg.text_field,
        "hf_dataset": cfg.hf_dataset, "tokenizer": tok.fingerprint, "max_bytes": cfg.max_bytes,
        "val_fraction": cfg.val_fraction, "bad_records": cfg.bad_records,
    }  # fmt: skip
    root = cache_root(cfg.cache_dir)
    docs = lambda: split_documents(capped(documents(cfg, files), cfg.max_bytes), cfg.val_fraction)  # noqa: E731
    got = cached_corpus(root, cache_key(parts), tok, docs, cfg.val_fraction, what)
    if len(got.train) < need or len(got.val) < need:
        raise UserError(
            f"data: {what} hold too little text for data.seq_len {cfg.seq_len} "
            f"({len(got.train)} train / {len(got.val)} val tokens)"
        )
    unit = "bytes" if tok.name == "bytes" else f"tokens ({tok.name})"
    desc = (
        f"{what}: {len(got.train):,} train / {len(got.val):,} val {unit}, "
        f"{'tokenized now' if got.built else 'cached'} in {root / 'tokens'}"
    )
    if got.meta.get("bad_records"):
        desc += f"; skipped {got.meta['bad_records']:,} bad records, the first: {got.meta['first_bad']}"
    return Corpus(got.train, got.val, desc, tok.vocab_size, tok.eos_id)


def check_vocab(corpus: Corpus, model_vocab: int) -> None:
    """The model must embed every id the tokenizer can emit (call after building the model)."""
    if corpus.vocab_size > model_vocab:
        raise UserError(
            f"data.tokenizer: its vocabulary has {corpus.vocab_size} tokens but the model embeds only "
            f"{model_vocab} (raise model.vocab_size, or model.config.vocab_size for hf: models)"
        )


def preflight(cfg: DataConfig, pack: bool = False) -> None:
    """Fail early, before any rank starts: the corpus is built here once (pretraining text tokenized; fine-tuning
    examples rendered, masked, packed as `pack` says), checked and cached, so that a missing file, a tokenizer
    that does not load, a bad record (data.bad_records) or too little text is one line before any rank starts,
    and the ranks read the cache."""
    if cfg.format != "text":
        from zoff.data.sft import load_sft_corpus  # (lazy: fine-tuning data only)

        load_sft_corpus(cfg, 0, pack)
        return
    if cfg.name != "synthetic":
        load_corpus(cfg, 0)
    else:  # (generating it costs a Python loop over every token: its sizes are known without)
        _check_synthetic_size(cfg)


def _synthetic_cut(cfg: DataConfig) -> int:
    """Where the synthetic stream splits into train and val (tokens before the cut train)."""
    n = cfg.synthetic_tokens
    return int(n * (1 - cfg.val_fraction)) if cfg.val_fraction > 0 else n - cfg.seq_len - 1


def _check_synthetic_size(cfg: DataConfig) -> None:
    """Each split holds a window of data.seq_len + 1 tokens, or one line naming the key (the run would
    otherwise train and fail in its final evaluation)."""
    need = cfg.seq_len + 1

    def splits(n: int) -> tuple[int, int]:
        cut = _synthetic_cut(replace(cfg, synthetic_tokens=n))
        return cut, n - cut

    train, val = splits(cfg.synthetic_tokens)
    if train < need or val < need:
        share = min(cfg.val_fraction, 1 - cfg.val_fraction)
        least = 2 * need if share <= 0 else int((need - 1) / share)  # a lower bound: the cut rounds down
        for _ in range(100_000):  # (the bound is near; a fraction too small for floats never gets there)
            if min(splits(least)) >= need:
                break
            least += 1
        else:
            raise UserError(
                f"data.val_fraction: {cfg.val_fraction} leaves no room for a validation split of {need:,} tokens "
                f"(data.seq_len {cfg.seq_len} + 1) in any corpus this size; raise it"
            )
        raise UserError(
            f"data.synthetic_tokens: {cfg.synthetic_tokens:,} tokens split into {max(train, 0):,} train / "
            f"{val:,} val, too few for data.seq_len {cfg.seq_len} (each split needs {need:,}); set "
            f"data.synthetic_tokens to at least {least:,}"
        )


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
    cut = _synthetic_cut(cfg)
    return Corpus(
        toks[:cut].to(torch.uint8), toks[cut:].to(torch.uint8), f"synthetic Markov bytes: {n:,} tokens"
    )
