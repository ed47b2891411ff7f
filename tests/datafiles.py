"""Test data shared by several test modules: small documents, jsonl/parquet writers, a tiny trained tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DOCS = [f"def f{i}(x):\n    return x * {i}  # dokument {i} — ünïcode\n" * (1 + i % 3) for i in range(40)]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str], key: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: docs, "id": list(range(len(docs)))}), path, row_group_size=7)
    return path


def make_tokenizer(folder: Path, texts: list[str], vocab: int = 300) -> Path:
    """A tiny byte-level BPE trained here, saved as a PreTrainedTokenizerFast folder (tokenizer.json + config)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(folder))
    except ImportError:  # the same files by hand: tokenizer.json and the config naming the eos token
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder
