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


# ChatML, with {% generation %} around each answer and its end of turn so that transformers can compute the
# reference mask; unknown roles are refused through raise_exception, as real templates do.
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = "the value of a function returns list name string number seven zero module json dumps".split()


def conversation(i: int) -> list[dict]:
    ask = f"What does {WORDS[i % len(WORDS)]} {i} do?"
    say = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 5))
    msgs = [{"role": "user", "content": ask}, {"role": "assistant", "content": say}]
    if i % 3 == 0:
        msgs = [{"role": "system", "content": "Answer briefly."}, *msgs]
    if i % 4 == 1:
        msgs += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": f"then {say}"}]
    return msgs


CONVERSATIONS = [conversation(i) for i in range(24)]


def save_tokenizer(src: Path, dst: Path, template: str | None) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(dst))
    return dst


def chat_llama_files(root: Path, seq_len: int) -> dict[str, str]:
    """A chat fine-tuning setup: a ChatML BPE tokenizer folder, a tiny random Llama folder (seed 3) whose
    vocabulary is the tokenizer's, and chat.jsonl of CONVERSATIONS twice. Paths by "tok", "llama", "data"."""
    import torch
    import transformers

    texts = [m["content"] for c in CONVERSATIONS for m in c] * 3
    tok_dir = save_tokenizer(make_tokenizer(root / "bpe", texts, vocab=320), root / "tok", CHATML)
    vocab = len(transformers.AutoTokenizer.from_pretrained(str(tok_dir)))
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, max_position_embeddings=seq_len, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 2))
    return {"tok": str(tok_dir), "llama": str(root / "llama"), "data": str(data)}
