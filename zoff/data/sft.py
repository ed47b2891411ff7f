"""Supervised fine-tuning data: chat and instruction records -> masked examples -> fixed-length sequences.

A record becomes one example: token ids t[0..n-1] and a trained flag per token (the answers' tokens, or every
token with data.train_on_prompt). The model reads t[0..n-2] and the target at position j is t[j+1] where
t[j+1] is trained, IGNORE elsewhere. So the last input of an example predicts that example's own last token,
never the first token of the example packed after it.

Chat masks come from the tokenizer's own chat template, without `{% generation %}` markers: the conversation is
rendered prefix by prefix, and the tokens that the rendering of messages[:i+1] adds after the rendering of
messages[:i] with the generation prompt are assistant message i's (its end-of-turn tokens included, as TRL and
torchtune train them). That needs every rendering to extend the previous one, which is checked.

Examples are packed (best fit, in record order) into sequences of exactly seq_len tokens whose position ids
restart at 0 at each example, the padding tail being an example of its own; unpacked, each example has a row
of its own, padded, and the micro-batches carry no position ids (the model's default 0..seq_len-1: padding
follows the example, so causal attention already keeps it out). Every k-th example is validation, as every
k-th document is for pretraining. The result is cached per machine like tokenized corpora.
"""

from __future__ import annotations

import bisect
import fcntl
import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zoff.config import DataConfig
from zoff.data.batch import IGNORE, MicroBatch
from zoff.data.corpus import GlobalBatches
from zoff.data.records import BadRecord, optional_module, read_records, record_fields
from zoff.data.sources import file_stat, source_files, split_documents
from zoff.data.tokenize import Tokenizer, cache_key, cache_root, load_tokenizer
from zoff.errors import UserError
from zoff.files.hub import tokenizer_folder

SFT_CACHE_VERSION = 1


@dataclass(frozen=True)
class SFTSplit:
    input_ids: torch.Tensor  # (n_seq, seq_len) int64
    targets: torch.Tensor  # (n_seq, seq_len) int64, IGNORE where no loss is taken
    position_ids: torch.Tensor  # (n_seq, seq_len) int64: restart at 0 per example when packed
    trained: torch.Tensor  # (n_seq,) int64: the targets that are not IGNORE, per sequence
    examples: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class SFTCorpus:
    train: SFTSplit
    val: SFTSplit
    description: str  # one line for the start-up plan, as Corpus.description
    vocab_size: int
    eos_id: int
    pad_id: int
    packed: bool
    stats: dict  # records, bad, truncated, dropped, examples; first_bad: where and why (or "")

    @property
    def seq_len(self) -> int:
        return self.train.input_ids.shape[1]


def load_sft_corpus(cfg: DataConfig, seed: int, pack: bool) -> SFTCorpus:
    """The chat or instruction records of cfg as train/val sequences of cfg.seq_len tokens.

    `pack` is resolved by the caller (data.packing and the model); `seed` is accepted for symmetry with
    load_corpus: the sequences do not depend on it (the sampler shuffles), so every seed shares one cache entry.
    """
    if cfg.format not in ("chat", "instruction"):
        raise UserError(f"data.format: {cfg.format} is not fine-tuning data (chat or instruction)")
    if cfg.name not in ("jsonl", "parquet", "hf"):
        raise UserError(f"data.name: format {cfg.format} reads jsonl, parquet or hf records, not {cfg.name}")
    tok = load_tokenizer(cfg.tokenizer, cfg.tokenizer_revision)
    enc = _Encoder(cfg, tok)
    files, what = source_files(cfg)
    parts = {
        "kind": "sft", "sft_version": SFT_CACHE_VERSION, "source": cfg.name, "files": [file_stat(f) for f in files],
        "hf_dataset": cfg.hf_dataset, "tokenizer": tok.fingerprint, "format": cfg.format,
        "fields": record_fields(cfg), "train_on_prompt": cfg.train_on_prompt, "overlong": cfg.overlong,
        "seq_len": cfg.seq_len, "pack": pack, "val_fraction": cfg.val_fraction, "pad_id": enc.pad_id,
        "bad_records": cfg.bad_records,
    }  # fmt: skip
    root = cache_root(cfg.cache_dir) / "sft"
    got, built = _cached(root, cache_key(parts), lambda: _build(cfg, enc, files, what, pack))
    stats = got["stats"]
    if stats["bad"]:
        warnings.warn(
            f"data: skipped {stats['bad']:,} of {stats['records']:,} records that make no example; "
            f"the first: {stats['first_bad']}",
            stacklevel=2,
        )
    train, val = (SFTSplit(**got[s]) for s in ("train", "val"))
    desc = _describe(
        cfg, what, stats, train, val, pack, f"{'tokenized now' if built else 'cached'} in {root}"
    )
    return SFTCorpus(train, val, desc, enc.vocab_size, tok.eos_id, enc.pad_id, pack, stats)


def _describe(
    cfg: DataConfig, what: str, st: dict, train: SFTSplit, val: SFTSplit, pack: bool, where: str
) -> str:
    how = "packed into" if pack else "one per row in"
    return (
        f"{what}, {cfg.format} ({cfg.tokenizer}): {st['examples']:,} examples ({train.examples:,} train / "
        f"{val.examples:,} val{', ' + st['val_note'] if st['val_note'] else ''}); skipped {st['bad']:,} bad "
        f"records, truncated {st['truncated']:,}, dropped {st['dropped']:,} (over seq_len {cfg.seq_len}, "
        f"overlong {cfg.overlong}); {how} {len(train):,} train / {len(val):,} val sequences, "
        f"{int(train.trained.sum()):,} / {int(val.trained.sum()):,} trained tokens; {where}"
    )


# -------------------------------------------------------------------------------------------- records


# ------------------------------------------------------------------------------------------- encoding


class _Encoder:
    """One record -> (token ids, trained flags), through the chat template when the tokenizer has one."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer):
        self.cfg, self.tok = cfg, tok
        self.hf = _hf_tokenizer(cfg, tok)
        self.templated = self.hf is not None and bool(getattr(self.hf, "chat_template", None))
        if cfg.format == "chat" and not self.templated:
            what = "'bytes'" if tok.name == "bytes" else f"{cfg.tokenizer}, which has no chat_template"
            raise UserError(
                f"data.tokenizer: format chat renders messages with the tokenizer's chat template; expected "
                f"a local Hugging Face tokenizer folder with a chat_template, got {what}"
            )
        pad = getattr(self.hf, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else tok.eos_id
        self.vocab_size = max(tok.vocab_size, len(self.hf) if self.hf is not None else 0)

    def __call__(self, where: str, rec: object) -> tuple[list[int], list[bool]]:
        if isinstance(rec, BadRecord):
            raise rec
        if not isinstance(rec, dict):
            raise BadRecord(f"not an object but {type(rec).__name__}")
        if self.cfg.format == "chat":
            return self._chat(where, _messages(rec, self.cfg))
        prompt, response = (_text(rec, f, k) for f, k in record_fields(self.cfg).items())
        if not response.strip():
            raise BadRecord(f"empty {self.cfg.response_field!r}")
        if self.templated:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self._chat(where, turns)
        p, r = (a.tolist() for a in self.tok.encode([prompt, response]))
        return p + r + [self.tok.eos_id], [self.cfg.train_on_prompt] * len(p) + [True] * (len(r) + 1)

    def _render(self, messages: list[dict], gen: bool) -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # the template's raise_exception (a role it rejects), a missing key
            raise BadRecord(
                f"the chat template rejects it ({(str(e) or type(e).__name__).splitlines()[0]})"
            ) from e

    def _chat(self, where: str, messages: list[dict]) -> tuple[list[int], list[bool]]:
        if self.cfg.train_on_prompt:  # every token trained: the whole rendering, no incremental check
            ids = self._encode([self._render(messages, False)])[0]
            return ids, [True] * len(ids)
        # Renderings, each extending the last; answer: what it adds is an assistant turn; step: names it.
        texts, answer, step = [], [], []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                texts.append(self._render(messages[:i], True))
                answer.append(False)
                step.append(f"messages[:{i}] with the generation prompt")
            texts.append(self._render(messages[: i + 1], False))
            answer.append(m["role"] == "assistant")
            step.append(f"messages[:{i + 1}]")
        for k in range(1, len(texts)):
            if not texts[k].startswith(texts[k - 1]):
                raise UserError(
                    f"data.tokenizer: the chat template of {self.cfg.tokenizer} rewrites earlier turns ({where}: "
                    f"its rendering of {step[k]} does not begin with that of {step[k - 1]}), so the answers' "
                    "tokens cannot be told apart; use another template, or data.train_on_prompt true"
                )
        ids = self._encode(texts)
        mask: list[bool] = []
        for k, (piece, trained) in enumerate(zip(ids, answer)):
            done = len(mask)
            if k and piece[:done] != ids[k - 1]:  # the text extends the last; its tokens must too
                raise BadRecord("its tokenization merges tokens across a turn boundary")
            mask += [trained] * (len(piece) - done)
        return ids[-1], mask

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # The template already wrote any BOS/special tokens: adding them again would double them.
        return self.hf(texts, add_special_tokens=False)["input_ids"]


def _hf_tokenizer(cfg: DataConfig, tok: Tokenizer):
    """transformers' tokenizer of data.tokenizer (for its chat template), or None: bytes or no transformers."""
    if tok.name == "bytes" or (cfg.format != "chat" and importlib.util.find_spec("transformers") is None):
        return None  # instruction data without transformers: prompt + response + eos
    auto = optional_module(
        "transformers", "data.format: chat needs transformers for chat templates"
    ).AutoTokenizer
    try:
        return auto.from_pretrained(str(tokenizer_folder(cfg)), local_files_only=True)
    except Exception as e:  # OSError, ValueError, KeyError (an unknown tokenizer_class), ...
        raise UserError(f"data.tokenizer: transformers cannot load {cfg.tokenizer}: {e}") from None


def _text(rec: dict, field: str, key: str) -> str:
    value = rec.get(field)
    if not isinstance(value, str):
        raise BadRecord(
            f"no string field '{field}' ({key})" if value is None else f"'{field}' is not a string"
        )
    return value


def _messages(rec: dict, cfg: DataConfig) -> list[dict]:
    msgs = rec.get(cfg.messages_field)
    if not isinstance(msgs, list) or not msgs:
        raise BadRecord(f"no list of messages in '{cfg.messages_field}' (data.messages_field)")
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRecord(f"message {i} is not a {{role, content}} object of strings")
        if m["role"] == "assistant" and not m["content"].strip():
            raise BadRecord(f"message {i} is an empty answer")
    if not cfg.train_on_prompt and not any(m["role"] == "assistant" for m in msgs):
        raise BadRecord("no assistant message")
    return msgs


# -------------------------------------------------------------------------------------- examples, split


def _build(cfg: DataConfig, enc: _Encoder, files: list[Path], what: str, pack: bool) -> dict:
    examples: list[tuple[np.ndarray, np.ndarray]] = []
    st = {"records": 0, "bad": 0, "truncated": 0, "dropped": 0, "first_bad": "", "val_note": ""}
    for where, rec in read_records(cfg, files):
        st["records"] += 1
        try:
            ids, mask = enc(where, rec)
            ids_np = np.asarray(ids, dtype=np.int64)
            x = ids_np[:-1]
            y = np.where(np.asarray(mask[1:], dtype=bool), ids_np[1:], IGNORE)  # the shift: t[j+1] at j
            if not (y != IGNORE).any():
                raise BadRecord("no trained token")
        except BadRecord as e:
            if cfg.bad_records == "error":
                raise UserError(f"{where}: {e} (data.bad_records: skip leaves such records out)") from None
            st["bad"] += 1
            st["first_bad"] = st["first_bad"] or f"{where}: {e}"
            continue
        if len(x) > cfg.seq_len:
            x, y = x[: cfg.seq_len], y[: cfg.seq_len]
            if cfg.overlong == "drop" or not (y != IGNORE).any():  # cut: the answer may be past the cut
                st["dropped"] += 1
                continue
            st["truncated"] += 1
        examples.append((x, y))
    if not examples:
        why = st["first_bad"] or f"all {st['dropped']:,} examples are longer than data.seq_len {cfg.seq_len}"
        raise UserError(f"data: {what} hold no usable {cfg.format} record ({st['records']:,} read); {why}")
    train, val, st["val_note"] = _val_split(examples, cfg.val_fraction)
    st["examples"] = len(examples)
    return {
        "train": _sequences(train, cfg.seq_len, pack, enc.pad_id),
        "val": _sequences(val, cfg.seq_len, pack, enc.pad_id),
        "stats": st,
    }


def _val_split(examples: list, val_fraction: float) -> tuple[list, list, str]:
    """Every k-th example is validation (zoff.data.sources.split_documents). Too few examples for one k: the last
    round(n * val_fraction) (at least one) are; a single example, or val_fraction 0, leaves the training
    split whole and validates on its last example (the description says so)."""
    train, val = [], []
    for is_val, ex in split_documents(examples, val_fraction):
        (val if is_val else train).append(ex)
    if val:
        return train, val, ""
    n = len(examples)
    if val_fraction > 0 and n >= 2:
        cut = n - min(n - 1, max(1, round(n * val_fraction)))
        return examples[:cut], examples[cut:], f"the last {n - cut} as val: fewer than one per val_fraction"
    return examples, examples[-1:], "val reuses the last training example"


def _bins(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Best fit in the given order: each example goes to the open sequence it fills most tightly."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, bin), sorted: the first with free >= n fits tightest
    for e, n in enumerate(lengths):
        at = bisect.bisect_left(room, (n, -1))
        free, b = room.pop(at) if at < len(room) else (seq_len, len(bins))
        if b == len(bins):
            bins.append([])
        bins[b].append(e)
        if free > n:
            bisect.insort(room, (free - n, b))
    return bins


def _sequences(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pack: bool, pad_id: int) -> dict:
    rows = _bins([len(x) for x, _ in examples], seq_len) if pack else [[e] for e in range(len(examples))]
    inputs = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    targets = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    pos = np.tile(np.arange(seq_len, dtype=np.int64), (len(rows), 1))
    count = np.arange(seq_len, dtype=np.int64)
    for r, members in enumerate(rows):
        at = 0
        for e in members:
            x, y = examples[e]
            inputs[r, at : at + len(x)], targets[r, at : at + len(x)] = x, y
            if pack:  # each example counts its own positions; the padding after the last is one more
                pos[r, at : at + len(x)] = count[: len(x)]
            at += len(x)
        if pack:
            pos[r, at:] = count[: seq_len - at]
    t = {"input_ids": inputs, "targets": targets, "position_ids": pos}
    out = {k: torch.from_numpy(v) for k, v in t.items()}
    return {**out, "trained": (out["targets"] != IGNORE).sum(1), "examples": len(examples)}


def _cached(root: Path, key: str, build: Callable[[], dict]) -> tuple[dict, bool]:
    """root/<key>.pt, built by the first rank of this machine to take its lock; the others wait and read it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"data.cache_dir: cannot create {root}: {e.strerror}") from None
    path, built = root / f"{key}.pt", False
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_file():
            tmp = path.with_name(f".tmp-{key}-{os.getpid()}.pt")
            torch.save(build(), tmp)
            os.replace(tmp, path)  # atomic: a crash never leaves half an entry
            built = True
    return torch.load(path, weights_only=True, mmap=True), built  # mapped: ranks share the pages


# ------------------------------------------------------------------------------------------------ sampler


class SFTBatches(GlobalBatches):
    """GlobalBatches over whole SFT sequences: the order (seed, step) fixes, rank r taking its contiguous slice
    of the global batch, and each micro-batch's loss_divisor making the step's loss the mean over the global
    batch's trained tokens. A sequence plays the part of a window: the parent's per-epoch permutation of its
    windows orders the sequences, and its state_dict (num_windows: the number of sequences) checks a resume.
    """

    def __init__(
        self,
        corpus: SFTCorpus,
        seq_len: int,
        micro_batch: int,
        grad_accum: int,
        rank: int,
        world: int,
        seed: int,
        sequence_parallel: int = 1,
    ):
        if corpus.seq_len != seq_len:
            raise ValueError(f"the corpus has sequences of {corpus.seq_len} tokens, not {seq_len}")
        super().__init__(  # type: ignore[arg-type]
            corpus, seq_len, micro_batch, grad_accum, rank, world, seed, sequence_parallel
        )
        self.num_windows = len(corpus.train)  # one epoch: every sequence once
        self._step, self._step_idx, self._step_divisor = -1, torch.empty(0), 1.0

    def micro_batch_at(self, step: int, micro: int) -> MicroBatch:
        """Micro-batch `micro` of this rank at training step `step` (0-based)."""
        if step != self._step:  # the global batch, once per step: every rank derives the same divisor
            samples = range(step * self.global_batch, (step + 1) * self.global_batch)
            idx = torch.stack([self.window_index(s) for s in samples])  # a window is a sequence here
            trained = int(self.corpus.train.trained[idx].sum())
            self._step, self._step_idx, self._step_divisor = step, idx, max(trained, 1) / self.world
        first = self.data_rank * self.micro_batch * self.grad_accum + micro * self.micro_batch
        idx = self._step_idx[first : first + self.micro_batch]
        return self._batch(self.corpus.train, idx, self._step_divisor)

    def val_batches(self, n_batches: int) -> list[MicroBatch]:
        """This rank's micro-batches of the first n global batches of the val split (fixed, unshuffled,
        wrapping). evaluate() averages micro_batch_loss over the micro-batches and the ranks; the divisor
        T / (micro-batches per rank * world), T the trained tokens of all n global batches, makes that the
        mean over those batches' trained tokens."""
        every = torch.arange(n_batches * self.global_batch) % len(self.corpus.val)
        trained = max(int(self.corpus.val.trained[every].sum()), 1)
        divisor = trained / (n_batches * self.grad_accum * self.world)
        out = []
        for b in range(n_batches):
            first = b * self.global_batch + self.data_rank * self.micro_batch * self.grad_accum
            for m in range(self.grad_accum):
                at = first + m * self.micro_batch
                out.append(self._batch(self.corpus.val, every[at : at + self.micro_batch], divisor))
        return out

    def _batch(self, split: SFTSplit, idx: torch.Tensor, divisor: float) -> MicroBatch:
        # Unpacked rows need no position ids (0..seq_len-1 is every model's default): models that cannot take
        # them still train, and none mistakes a row's padding for a packed example.
        pos = split.position_ids[idx] if self.corpus.packed else None
        return MicroBatch(split.input_ids[idx], split.targets[idx], pos, divisor).shard(
            self.shard, self.shards
        )
