"""Tokenizers (bytes, or a local Hugging Face tokenizer directory) and the on-disk cache of tokenized corpora.

A corpus is tokenized once per machine: every rank asks `cached_corpus` for the same key, the first one to
take the key's file lock builds the entry, and the others wait for the lock and then map the finished files.
An entry is built in a temporary folder and renamed into place, so a crash never leaves half an entry.
Every build appends one line to <cache>/tokens/builds.log, which says when the work was actually done.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zoff.data.jsonl import Bad
from zoff.errors import UserError
from zoff.host.cache import cache_dir as zoff_cache_dir

BYTES_EOS = 0  # the NUL byte never occurs in text, so byte-level corpora keep a 256-token vocabulary
CACHE_VERSION = 2
ENCODE_BATCH = 512  # documents per encode call: the Rust tokenizer parallelises over them
NOT_TOKENIZER_FILES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".py", ".index.json")
# a model folder that is also its tokenizer's (a Hub repository, usually): its model files are not the tokenizer's
MODEL_FILES = ("config.json", "generation_config.json")


class Tokenizer:
    """Text -> token ids, with the end-of-document id and a fingerprint that changes with the vocabulary."""

    name: str
    vocab_size: int
    eos_id: int
    fingerprint: str
    dtype: np.dtype

    def encode(self, docs: list[str | bytes]) -> list[np.ndarray]:
        raise NotImplementedError

    def files(self) -> list[Path]:
        """Files that describe the tokenizer (copied next to an exported model)."""
        return []


class ByteTokenizer(Tokenizer):
    name, vocab_size, eos_id, fingerprint = "bytes", 256, BYTES_EOS, "bytes-v1"
    dtype = np.dtype(np.uint8)

    def encode(self, docs: list[str | bytes]) -> list[np.ndarray]:
        return [np.frombuffer(d.encode() if isinstance(d, str) else d, dtype=np.uint8) for d in docs]


class HFTokenizer(Tokenizer):
    """A local tokenizer directory: tokenizer.json through `tokenizers`, anything else through transformers."""

    dtype = np.dtype(np.int32)

    def __init__(self, path: Path):
        self.path, self.name = path, str(path)
        self._files = sorted(
            f
            for f in path.iterdir()
            if f.is_file() and not f.name.endswith(NOT_TOKENIZER_FILES) and f.name not in MODEL_FILES
        )
        digest = hashlib.sha256()
        for f in self._files:
            digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        self.fingerprint = digest.hexdigest()[:16]
        if (path / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer as RustTokenizer
            except ImportError:
                raise UserError(
                    "data.tokenizer: a Hugging Face tokenizer needs the tokenizers package: pip install zoff[hf]"
                ) from None
            self._tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self.eos_id = self._find_eos(self._tok.token_to_id)
            self._encode = lambda docs: [
                e.ids for e in self._tok.encode_batch(docs, add_special_tokens=False)
            ]
        else:  # sentencepiece and other slow tokenizers: only transformers knows how to load them
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise UserError(
                    f"data.tokenizer: {path} has no tokenizer.json; loading it needs transformers: pip install zoff[hf]"
                ) from None
            try:
                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as e:
                raise UserError(f"data.tokenizer: cannot load a tokenizer from {path}: {e}") from None
            self.vocab_size = len(tok)
            self.eos_id = (
                tok.eos_token_id
                if tok.eos_token_id is not None
                else self._find_eos(tok.convert_tokens_to_ids)
            )
            self._encode = lambda docs: tok(docs, add_special_tokens=False)["input_ids"]

    def _find_eos(self, token_to_id: Callable[[str], int | None]) -> int:
        """The eos_token its config names, else a conventional end-of-text token present in the vocabulary."""
        names = []
        for cfg_name in ("tokenizer_config.json", "special_tokens_map.json"):
            f = self.path / cfg_name
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token")
                names.append(eos.get("content") if isinstance(eos, dict) else eos)
        for name in [*names, "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]:
            tid = token_to_id(name) if isinstance(name, str) else None
            if tid is not None and tid >= 0:
                return int(tid)
        raise UserError(
            f"data.tokenizer: {self.path} names no eos_token (set one in its tokenizer_config.json): "
            "documents are packed with an end-of-document token between them"
        )

    def encode(self, docs: list[str | bytes]) -> list[np.ndarray]:
        text = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        return [np.asarray(ids, dtype=np.int32) for ids in self._encode(text)]

    def files(self) -> list[Path]:
        return list(self._files)


def load_tokenizer(spec: str, revision: str | None = None) -> Tokenizer:
    """'bytes', a tokenizer folder, or a Hub id (data.tokenizer, at data.tokenizer_revision)."""
    if spec == "bytes":
        return ByteTokenizer()
    from zoff.files.hub import TOKENIZER_FILES, folder

    path = folder(spec, revision, "data.tokenizer", TOKENIZER_FILES)
    if not path.is_dir():
        raise UserError(f"data.tokenizer: '{spec}' is neither 'bytes' nor a tokenizer directory")
    try:
        return HFTokenizer(path)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers and transformers raise bare Exceptions on bad files
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"data.tokenizer: {path}: cannot load its tokenizer ({first})") from None


# ------------------------------------------------------------------------------------------------ cache


@dataclass(frozen=True)
class TokenizedCorpus:
    train: torch.Tensor
    val: torch.Tensor
    meta: dict
    built: bool  # True when this process did the tokenization


def cache_root(cache_dir: str | None) -> Path:
    """data.cache_dir when set, else zoff's cache folder (zoff.host.cache)."""
    return Path(cache_dir).expanduser() if cache_dir else zoff_cache_dir()


def cache_key(parts: dict) -> str:
    blob = json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cached_corpus(
    root: Path,
    key: str,
    tok: Tokenizer,
    docs: Callable[[], Iterable[tuple[bool, str | bytes]]],
    val_fraction: float,
    description: str,
) -> TokenizedCorpus:
    """The entry `key` under root/tokens, built from `docs()` (pairs of (is_val, document)) if it is missing."""
    tokens = root / "tokens"
    try:
        tokens.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"data.cache_dir: cannot create {tokens}: {e.strerror}") from None
    entry = tokens / key
    built = False
    with open(tokens / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of this machine wait here while one builds
        try:
            if not (entry / "meta.json").is_file():
                _build(entry, tok, docs(), val_fraction, description)
                built = True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    meta = json.loads((entry / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    return TokenizedCorpus(_map(entry / "train.bin", dtype), _map(entry / "val.bin", dtype), meta, built)


def _build(
    entry: Path, tok: Tokenizer, docs: Iterable[tuple[bool, str | bytes]], val_fraction: float, what: str
) -> None:
    for stale in entry.parent.glob(f".tmp-{entry.name}-*"):  # a build that crashed; we hold the key's lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = entry.with_name(f".tmp-{entry.name}-{os.getpid()}")
    tmp.mkdir()
    t0 = time.perf_counter()
    eos = np.asarray([tok.eos_id], dtype=tok.dtype)
    counts, n_docs, bad = {True: 0, False: 0}, 0, {"count": 0, "first": ""}

    def good(pairs: Iterable[tuple[bool, str | bytes]]) -> Iterator[tuple[bool, str | bytes]]:
        for pair in pairs:
            if isinstance(pair[1], Bad):  # data.bad_records: skip (counted; only the first is kept)
                bad["count"] += 1
                bad["first"] = bad["first"] or str(pair[1])
            else:
                yield pair

    with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
        for batch in _batches(good(docs), ENCODE_BATCH):
            for (is_val, _), ids in zip(batch, tok.encode([d for _, d in batch])):
                f = fval if is_val else ftrain
                f.write(ids.astype(tok.dtype, copy=False).tobytes())
                f.write(eos.tobytes())
                counts[is_val] += len(ids) + 1
                n_docs += 1
    if n_docs == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        skipped = (
            f" ({bad['count']:,} bad records skipped; the first: {bad['first']})" if bad["count"] else ""
        )
        raise UserError(f"data: {what} holds no documents{skipped}")
    if counts[True] == 0 and val_fraction > 0:  # one document (or too few): its tail is the validation split
        cut = int(counts[False] * (1 - val_fraction))
        _move_tail(tmp / "train.bin", tmp / "val.bin", cut * tok.dtype.itemsize)
        counts = {False: cut, True: counts[False] - cut}
    meta = {
        "dtype": tok.dtype.name, "train_tokens": counts[False], "val_tokens": counts[True], "documents": n_docs,
        "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tok.name, "source": what,
        "seconds": round(time.perf_counter() - t0, 3), "bad_records": bad["count"], "first_bad": bad["first"],
    }  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    os.rename(tmp, entry)
    with open(entry.parent / "builds.log", "a") as log:  # one line per tokenization: what tests count
        log.write(json.dumps({"key": entry.name, "pid": os.getpid(), "time": time.time(), **meta}) + "\n")


def _batches(items: Iterable, n: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _move_tail(src: Path, dst: Path, cut_bytes: int) -> None:
    with open(src, "rb+") as f, open(dst, "wb") as out:
        f.seek(cut_bytes)
        shutil.copyfileobj(f, out)
        f.truncate(cut_bytes)


def _map(path: Path, dtype: np.dtype) -> torch.Tensor:
    """Map a token file copy-on-write: ranks on one machine share its pages instead of holding copies."""
    if path.stat().st_size == 0:
        return torch.empty(0, dtype=torch.from_numpy(np.empty(0, dtype)).dtype)
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c"))
