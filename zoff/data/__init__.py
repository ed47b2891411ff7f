"""Datasets and the global-batch sampler.

Documents come from the Python standard library, text files, JSON lines, Parquet files or a `datasets` spec on
local files; they are tokenized once per machine into a cached token stream (zoff.data.tokenize) with an
end-of-document token after each, and every k-th document goes to the validation split.

The sample order is a pure function of (seed, step) for the *global* batch, and rank r takes its contiguous
slice. So a run is reproducible, resumes mid-epoch from the step alone, and the same global batch split over
a different number of ranks sees exactly the same samples (elastic restarts depend on this).
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from zoff.config import DataConfig
from zoff.data.batch import MicroBatch
from zoff.data.jsonl import Bad
from zoff.data.tokenize import cache_key, cache_root, cached_corpus, load_tokenizer
from zoff.errors import UserError

VOCAB_BYTES = 256


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # 1-D uint8/int32/int64 token ids
    val: torch.Tensor
    description: str
    vocab_size: int = VOCAB_BYTES  # the tokenizer's: every id is below it
    eos_id: int | None = None


def load_corpus(cfg: DataConfig, seed: int) -> Corpus:
    need = cfg.seq_len + 1  # one window of each split (the final evaluation reads the val split too)
    if cfg.name == "synthetic":
        _check_synthetic_size(cfg)
        return _synthetic(cfg, seed)
    tok = load_tokenizer(cfg.tokenizer, cfg.tokenizer_revision)
    files, what = _source_files(cfg)
    parts = {
        "source": cfg.name, "files": [_stat(f) for f in files], "text_field": cfg.text_field,
        "hf_dataset": cfg.hf_dataset, "tokenizer": tok.fingerprint, "max_bytes": cfg.max_bytes,
        "val_fraction": cfg.val_fraction, "bad_records": cfg.bad_records,
    }  # fmt: skip
    root = cache_root(cfg.cache_dir)
    docs = lambda: _split(_capped(_documents(cfg, files), cfg.max_bytes), cfg.val_fraction)  # noqa: E731
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
        from zoff.data.sft import load_sft_corpus  # (sft imports this module)

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


# ---------------------------------------------------------------------------------------------- sources


def _source_files(cfg: DataConfig) -> tuple[list[Path], str]:
    if cfg.name == "stdlib-source":
        return _stdlib_files(), "the Python standard library's .py sources"
    if cfg.name == "hf":
        spec = cfg.hf_dataset
        if not spec.get("path"):
            raise UserError(
                "data.hf_dataset.path: needed for data.name hf (json, parquet, text, csv or a local dataset folder)"
            )
        files = _expand(cfg.paths, "data.paths") if cfg.paths else []
        files += _expand(_strings(spec.get("data_files")), "data.hf_dataset.data_files")
        if Path(str(spec["path"])).exists():
            root = Path(str(spec["path"]))
            files += sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
        return files, f"datasets.load_dataset({spec.get('path')!r})"
    if not cfg.paths:
        raise UserError(f"data.paths: data.name '{cfg.name}' needs at least one file or glob")
    files = _expand(cfg.paths)
    if not files:
        raise UserError(f"data.paths: {cfg.paths} match no file")
    return files, f"{len(files)} {cfg.name} file(s)"


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "idlelib", "dist-packages"}
    files = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # pruned, not filtered: site-packages can be huge
        files.extend(Path(top) / n for n in names if n.endswith(".py"))
    return sorted(files)


def _expand(patterns: list[str], key: str = "data.paths") -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(str(Path(pat).expanduser()), recursive=True))
        if not hits:
            raise UserError(f"{key}: '{pat}' matches no file")
        files.extend(Path(h) for h in hits if Path(h).is_file())
    return files


def _strings(value) -> list[str]:
    """The paths in a load_dataset data_files value: a string, a list, or a dict of split -> either."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return [str(v) for v in value]


def _stat(f: Path) -> tuple[str, int, int]:
    st = f.stat()
    return str(f.resolve()), st.st_size, st.st_mtime_ns


def _documents(cfg: DataConfig, files: list[Path]) -> Iterator[str | bytes]:
    """The documents, in order; a bad one is an error or, with data.bad_records: skip, a Bad value that the
    tokenization counts and leaves out."""
    if cfg.name in ("stdlib-source", "text"):
        for f in files:  # bytes: the byte tokenizer keeps them exact; a tokenizer of text decodes them
            raw = f.read_bytes()
            if cfg.tokenizer == "bytes":
                yield raw
                continue
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:  # not text with replacement characters trained on
                yield _bad(cfg, f"{f}: invalid UTF-8 at byte {e.start}")
    elif cfg.name == "jsonl":
        for f in files:
            yield from _jsonl(cfg, f)
    elif cfg.name == "parquet":
        for f in files:
            yield from _texts(cfg, str(f), _parquet(f, cfg.text_field))
    else:
        yield from _texts(cfg, f"data.hf_dataset {cfg.hf_dataset.get('path')}", _hf_dataset(cfg))


def _texts(cfg: DataConfig, where: str, values: Iterable[object]) -> Iterator[str]:
    """A column's texts: an empty cell is no document; a value that is not text is a bad record."""
    for row, t in enumerate(values):
        if isinstance(t, str):
            yield t
        elif t is not None:
            yield _bad(
                cfg, f"{where}: row {row}: data.text_field '{cfg.text_field}' holds {type(t).__name__}"
            )


def _jsonl(cfg: DataConfig, path: Path) -> Iterator[str]:
    """Pretraining text from JSON Lines (jsonl.py bounds and checks each line)."""
    from zoff.data.jsonl import jsonl

    for lineno, obj in jsonl(path, cfg.max_line_bytes):
        text = obj.get(cfg.text_field) if isinstance(obj, dict) else None
        if isinstance(obj, Bad):
            yield _bad(cfg, f"{path}:{lineno}: {obj}")
        elif not isinstance(text, str):
            yield _bad(cfg, f"{path}:{lineno}: no text field '{cfg.text_field}' (data.text_field)")
        else:
            yield text


def _bad(cfg: DataConfig, why: str) -> Bad:
    """A bad pretraining document: the error that stops the run (data.bad_records auto or error), or the
    Bad value the tokenization counts and skips."""
    if cfg.bad_records == "skip":
        return Bad(why)
    raise UserError(f"{why} (data.bad_records: skip leaves such records out)")


def _parquet(path: Path, key: str) -> Iterator[object]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("data.name: parquet needs pyarrow: pip install zoff[data]") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid/OSError family for a bad file
        raise UserError(f"{path}: not a Parquet file ({e})") from None
    if key not in pf.schema_arrow.names:
        raise UserError(
            f"{path}: no column '{key}' (data.text_field); columns: {', '.join(pf.schema_arrow.names)}"
        )
    for batch in pf.iter_batches(columns=[key], batch_size=1024):
        yield from batch.column(0).to_pylist()


def _hf_dataset(cfg: DataConfig) -> Iterator[object]:
    try:
        import datasets
    except ImportError:
        raise UserError("data.name: hf needs the datasets package: pip install zoff[data]") from None
    args = dict(cfg.hf_dataset)
    if "data_files" not in args and cfg.paths:
        args["data_files"] = [str(f) for f in _expand(cfg.paths)]
    try:
        ds = datasets.load_dataset(**args)
    except Exception as e:  # datasets raises many kinds: FileNotFoundError, ValueError, its own errors
        raise UserError(f"data.hf_dataset: load_dataset failed: {str(e).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if cfg.text_field not in ds.column_names:
        raise UserError(
            f"data.text_field: the dataset has no column '{cfg.text_field}' (columns: {', '.join(ds.column_names)})"
        )
    for batch in ds.select_columns([cfg.text_field]).iter(batch_size=1024):
        yield from batch[cfg.text_field]


def _capped(docs: Iterable[str | bytes], max_bytes: int) -> Iterator[str | bytes]:
    """Stop after max_bytes of text (0: no cap); the last document is cut at the cap."""
    size = 0
    for d in docs:
        if isinstance(d, Bad):  # counted by the tokenization, never trained on
            yield d
            continue
        raw = d if isinstance(d, bytes) else d.encode()
        if max_bytes and size + len(raw) > max_bytes:
            raw = raw[: max_bytes - size]
            d = raw if isinstance(d, bytes) else raw.decode(errors="ignore")
        size += len(raw)
        yield d
        if max_bytes and size >= max_bytes:
            return


def _split(docs: Iterable[str | bytes], val_fraction: float) -> Iterator[tuple[bool, str | bytes]]:
    """Every k-th document goes to validation, so both splits sample the whole corpus, not its tail."""
    k = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
    i = 0
    for d in docs:
        if isinstance(d, Bad):  # takes no place: the split of the good documents does not move
            yield False, d
            continue
        yield bool(k and i % k == k - 1), d
        i += 1


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

    def micro_batch_at(self, step: int, micro: int) -> MicroBatch:
        """Inputs and targets of micro-batch `micro` of this rank at training step `step` (0-based)."""
        first = (
            step * self.global_batch
            + self.rank * self.micro_batch * self.grad_accum
            + micro * self.micro_batch
        )
        windows = (
            torch.stack([self.window_index(i) for i in range(first, first + self.micro_batch)]) * self.seq_len
        )
        return MicroBatch(*self._xy(self.corpus.train, windows))

    def val_batches(self, n_batches: int) -> list[MicroBatch]:
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
                out.append(MicroBatch(*self._xy(self.corpus.val, idx * self.seq_len)))
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
