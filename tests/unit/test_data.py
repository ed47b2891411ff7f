"""Document sources (text, jsonl, parquet, hf), tokenizers (bytes, a local HF tokenizer), packing and the cache."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from tests.datafiles import DOCS, make_tokenizer, write_jsonl, write_parquet
from zoff.config import config_from_dict
from zoff.data import GlobalBatches, check_vocab, load_corpus
from zoff.data.tokenize import BYTES_EOS, load_tokenizer
from zoff.errors import UserError


def data_cfg(tmp_path: Path, **data) -> object:
    base = {"seq_len": 8, "batch_size": 2, "val_fraction": 0.25, "cache_dir": str(tmp_path / "cache")}
    return config_from_dict({"data": {**base, **data}}).data


def builds(tmp_path: Path) -> list[dict]:
    log = tmp_path / "cache" / "tokens" / "builds.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def packed(docs: list[bytes | list[int]], eos: int) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += list(d) + [eos]
    return out


# ------------------------------------------------------------------------------------------- sources


def test_text_files_are_bytes_with_an_eos_between_documents(tmp_path):
    files = []
    for i, d in enumerate(DOCS[:8]):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_bytes(d.encode())
    c = load_corpus(data_cfg(tmp_path, name="text", paths=[str(tmp_path / "f*.py")]), 0)
    raw = [f.read_bytes() for f in sorted(files)]
    # val_fraction 0.25: every 4th document is validation, so both splits sample the whole corpus
    assert c.train.tolist() == packed([d for i, d in enumerate(raw) if i % 4 != 3], BYTES_EOS)
    assert c.val.tolist() == packed([d for i, d in enumerate(raw) if i % 4 == 3], BYTES_EOS)
    assert c.train.dtype == torch.uint8 and c.vocab_size == 256 and c.eos_id == BYTES_EOS


def test_one_document_gives_its_tail_to_validation(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"abcdefghij" * 10)
    c = load_corpus(data_cfg(tmp_path, name="text", paths=[str(tmp_path / "one.txt")]), 0)
    stream = list(b"abcdefghij" * 10) + [BYTES_EOS]
    assert c.train.tolist() + c.val.tolist() == stream
    assert len(c.train) == int(len(stream) * 0.75)


def test_max_bytes_caps_the_text_read(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    c = load_corpus(data_cfg(tmp_path, name="jsonl", paths=[str(tmp_path / "d.jsonl")], max_bytes=300), 0)
    text = bytes(t for t in c.train.tolist() + c.val.tolist() if t != BYTES_EOS)
    assert len(text) <= 300 and text.decode(errors="ignore").startswith(DOCS[0][:50])


def test_jsonl_parquet_and_hf_give_the_same_stream(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", DOCS, key="body")
    write_parquet(tmp_path / "d.parquet", DOCS, key="body")
    jsonl = load_corpus(
        data_cfg(tmp_path, name="jsonl", paths=[str(tmp_path / "d.jsonl")], text_field="body"), 0
    )
    pq = load_corpus(
        data_cfg(tmp_path, name="parquet", paths=[str(tmp_path / "d.parquet")], text_field="body"), 0
    )
    want = [d.encode() for i, d in enumerate(DOCS) if i % 4 != 3]
    assert jsonl.train.tolist() == packed(want, BYTES_EOS)
    assert pq.train.tolist() == jsonl.train.tolist() and pq.val.tolist() == jsonl.val.tolist()
    pytest.importorskip("datasets")
    spec = {"path": "json", "cache_dir": str(tmp_path / "hf-cache")}
    hf = load_corpus(
        data_cfg(tmp_path, name="hf", paths=[str(tmp_path / "d.jsonl")], text_field="body", hf_dataset=spec),
        0,
    )
    assert hf.train.tolist() == jsonl.train.tolist() and hf.val.tolist() == jsonl.val.tolist()


@pytest.mark.parametrize(
    "name, content, key, message",
    [
        (
            "jsonl",
            '{"text": "a"}\n{not json\n',
            "text",
            ":2: not valid JSON (Expecting property name enclosed in double quotes)",
        ),
        ("jsonl", '{"text": "a"}\n{"body": "b"}\n', "text", ":2: no text field 'text' (data.text_field)"),
        ("parquet", None, "nope", ": no column 'nope' (data.text_field); columns: text, id"),
    ],
)
def test_bad_records_name_the_file_and_the_key(tmp_path, name, content, key, message):
    path = tmp_path / f"d.{name}"
    if content is None:
        write_parquet(path, DOCS)
    else:
        path.write_text(content)
    with pytest.raises(UserError) as e:
        load_corpus(data_cfg(tmp_path, name=name, paths=[str(path)], text_field=key), 0)
    skip = " (data.bad_records: skip leaves such records out)" if name == "jsonl" else ""
    assert str(e.value) == f"{path}{message}{skip}"


def test_missing_paths_and_tokenizers_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match=r"^data.paths: data.name 'jsonl' needs at least one file or glob$"):
        load_corpus(data_cfg(tmp_path, name="jsonl"), 0)
    with pytest.raises(UserError, match=r"^data.paths: '.*nope\*.jsonl' matches no file$"):
        load_corpus(data_cfg(tmp_path, name="jsonl", paths=[str(tmp_path / "nope*.jsonl")]), 0)
    with pytest.raises(
        UserError, match=r"^data.tokenizer: '.*' is neither 'bytes' nor a tokenizer directory$"
    ):
        load_corpus(data_cfg(tmp_path, name="stdlib-source", tokenizer=str(tmp_path / "no-such-dir")), 0)
    with pytest.raises(UserError, match=r"^data.hf_dataset.path: needed for data.name hf"):
        load_corpus(data_cfg(tmp_path, name="hf", paths=[str(tmp_path)]), 0)


# ----------------------------------------------------------------------------------------- tokenizers


def test_hf_tokenizer_directory_packs_documents_with_its_eos(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", DOCS)
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    c = load_corpus(
        data_cfg(tmp_path, name="jsonl", paths=[str(tmp_path / "d.jsonl")], tokenizer=str(tok_dir)), 0
    )
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = ref.token_to_id("<|endoftext|>")
    want = [ref.encode(d, add_special_tokens=False).ids for i, d in enumerate(DOCS) if i % 4 != 3]
    assert c.train.tolist() == packed(want, eos)
    assert c.eos_id == eos and c.vocab_size == ref.get_vocab_size() and c.train.dtype == torch.int32
    assert len(c.train) < sum(len(d.encode()) for d in DOCS)  # BPE merges: fewer tokens than bytes
    assert ref.decode(c.train[: len(want[0])].tolist()) == DOCS[0]
    # The batches a model sees come from that stream (inputs/targets shifted by one).
    x, y = GlobalBatches(c, 8, 2, 1, 0, 1, seed=0).micro_batch_at(0, 0)
    assert x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < c.vocab_size


def test_vocab_that_does_not_fit_the_model_is_a_clear_error(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", DOCS, vocab=300)
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    c = load_corpus(
        data_cfg(tmp_path, name="jsonl", paths=[str(tmp_path / "d.jsonl")], tokenizer=str(tok_dir)), 0
    )
    check_vocab(c, 300)
    with pytest.raises(
        UserError, match=r"^data.tokenizer: its vocabulary has 300 tokens but the model embeds only 256"
    ):
        check_vocab(c, 256)


def test_tokenizer_without_eos_is_an_error(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", DOCS)
    for f in tok_dir.iterdir():
        if f.name != "tokenizer.json":
            f.unlink()
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    data["added_tokens"] = []
    data["model"]["vocab"].pop("<|endoftext|>")
    (tok_dir / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"names no eos_token"):
        load_tokenizer(str(tok_dir))


# ---------------------------------------------------------------------------------------------- cache


def test_cache_tokenizes_once_and_again_when_the_files_change(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    cfg = data_cfg(tmp_path, name="jsonl", paths=[str(path)])
    first = load_corpus(cfg, 0)
    second = load_corpus(cfg, 0)
    assert "tokenized now" in first.description and "cached" in second.description
    assert torch.equal(first.train, second.train) and len(builds(tmp_path)) == 1
    write_jsonl(path, DOCS[:-1])
    again = load_corpus(cfg, 0)
    assert len(again.train) + len(again.val) < len(first.train) + len(first.val)
    assert len(builds(tmp_path)) == 2
    load_corpus(data_cfg(tmp_path, name="jsonl", paths=[str(path)], val_fraction=0.1), 0)
    assert len(builds(tmp_path)) == 3  # the split is part of the key


def _load(cfg_dict: dict, out: str, i: int) -> None:
    c = load_corpus(config_from_dict({"data": cfg_dict}).data, 0)
    Path(out, f"{i}.txt").write_text(str(c.train[:64].tolist()))


def test_concurrent_loaders_on_one_machine_tokenize_once(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", DOCS)
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 20)
    cfg = {"name": "jsonl", "paths": [str(path)], "tokenizer": str(tok_dir), "seq_len": 8,
           "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    ctx = mp.get_context("fork")  # like the ranks of one node: separate processes, one cache folder
    procs = [ctx.Process(target=_load, args=(cfg, str(tmp_path), i)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(builds(tmp_path)) == 1
    assert len({(tmp_path / f"{i}.txt").read_text() for i in range(3)}) == 1
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("val_fraction", [0.05, 0.0])
def test_synthetic_tokens_too_few_for_a_window_of_each_split_is_one_line(val_fraction: float) -> None:
    """The val split must hold a window too (the final evaluation reads it): once an IndexError after the
    whole run had trained. The error names the key and the smallest count that works, and that count works."""
    from zoff.data import preflight

    cfg = lambda n: config_from_dict(  # noqa: E731
        {"model": {"name": "gpt", "seq_len": 1024},
         "data": {"name": "synthetic", "seq_len": 1024, "synthetic_tokens": n, "val_fraction": val_fraction}}
    ).data  # fmt: skip
    with pytest.raises(UserError) as e:
        preflight(cfg(2000))
    msg = str(e.value)
    assert msg.startswith("data.synthetic_tokens: 2,000 tokens split into") and "data.seq_len 1024" in msg
    least = int(msg.rsplit("at least ", 1)[1].replace(",", ""))
    preflight(cfg(least))
    corpus = load_corpus(cfg(least), 0)
    assert min(len(corpus.train), len(corpus.val)) >= 1025
    with pytest.raises(UserError, match="data.synthetic_tokens"):
        preflight(cfg(least - 1))
