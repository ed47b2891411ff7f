"""data.bad_records (issue 33): a record that cannot be read stops the run naming it (error), or is left out,
counted and named (skip), for pretraining text and fine-tuning records alike; what is skipped takes no place,
so the corpus equals the one built from the good records alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.datafiles import DOCS, make_tokenizer
from zoff.config import config_from_dict
from zoff.data import load_corpus, preflight
from zoff.errors import UserError


def cfg(tmp_path: Path, **data) -> object:
    base = {"seq_len": 8, "batch_size": 2, "val_fraction": 0.25, "cache_dir": str(tmp_path / "cache")}
    return config_from_dict({"data": {**base, **data}}).data


def lines(path: Path, *rows: bytes) -> Path:
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


def good_and_bad(tmp_path: Path) -> tuple[Path, Path]:
    """The same good documents, alone and with every kind of bad line between them."""
    good = [json.dumps({"text": d}).encode() for d in DOCS[:8]]
    bad = [b'{"text": "caf\xe9"}', b"{not json", b'{"body": "no text field"}', b"[" * 3000 + b"]" * 3000]
    mixed = [good[0], bad[0], good[1], good[2], bad[1], *good[3:6], bad[2], bad[3], *good[6:]]
    return lines(tmp_path / "good.jsonl", *good), lines(tmp_path / "mixed.jsonl", *mixed)


def test_pretraining_errors_by_default_naming_the_line(tmp_path: Path) -> None:
    _, mixed = good_and_bad(tmp_path)
    for mode in ("auto", "error"):
        with pytest.raises(UserError, match=r"mixed\.jsonl:2: invalid UTF-8 at byte 13 \(data\.bad_records"):
            load_corpus(cfg(tmp_path, name="jsonl", paths=[str(mixed)], bad_records=mode), 0)


def test_pretraining_skip_counts_and_equals_the_good_lines_alone(tmp_path: Path) -> None:
    good, mixed = good_and_bad(tmp_path)
    want = load_corpus(cfg(tmp_path, name="jsonl", paths=[str(good)]), 0)
    got = load_corpus(cfg(tmp_path, name="jsonl", paths=[str(mixed)], bad_records="skip"), 0)
    assert got.train.tolist() == want.train.tolist() and got.val.tolist() == want.val.tolist()
    assert "skipped 4 bad records, the first: " in got.description
    assert got.description.endswith("mixed.jsonl:2: invalid UTF-8 at byte 13")
    again = load_corpus(cfg(tmp_path, name="jsonl", paths=[str(mixed)], bad_records="skip"), 0)
    assert "cached" in again.description and "skipped 4 bad records" in again.description
    # The cache built with skip never answers for error: the setting is part of its key.
    with pytest.raises(UserError, match=r"mixed\.jsonl:2"):
        load_corpus(cfg(tmp_path, name="jsonl", paths=[str(mixed)], bad_records="error"), 0)


def test_only_bad_records_is_one_line_naming_the_first(tmp_path: Path) -> None:
    p = lines(tmp_path / "all-bad.jsonl", b"{not json", b'{"text": 3}')
    with pytest.raises(
        UserError, match=r"holds no documents \(2 bad records skipped; the first: .*:1: not valid"
    ):
        load_corpus(cfg(tmp_path, name="jsonl", paths=[str(p)], bad_records="skip"), 0)


def test_text_files_that_are_not_utf8_are_bad_for_a_text_tokenizer_and_exact_for_bytes(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tokenizers")
    tok = make_tokenizer(tmp_path / "tok", DOCS)
    for i, d in enumerate(DOCS[:6]):
        (tmp_path / f"f{i}.txt").write_bytes(d.encode())
    (tmp_path / "f9.txt").write_bytes(b"latin-1 caf\xe9\n")
    paths = [str(tmp_path / "f*.txt")]
    with pytest.raises(UserError, match=r"f9\.txt: invalid UTF-8 at byte 11 \(data\.bad_records"):
        load_corpus(cfg(tmp_path, name="text", paths=paths, tokenizer=str(tok)), 0)
    skipped = load_corpus(cfg(tmp_path, name="text", paths=paths, tokenizer=str(tok), bad_records="skip"), 0)
    assert "skipped 1 bad records" in skipped.description
    exact = load_corpus(cfg(tmp_path, name="text", paths=paths), 0)  # bytes: every byte is a token
    assert 0xE9 in exact.train.tolist() + exact.val.tolist() and "skipped" not in exact.description


def test_a_column_value_that_is_not_text_is_a_bad_record(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": pa.array([DOCS[0], None, DOCS[1], DOCS[2]] * 2)}), p)
    ok = load_corpus(cfg(tmp_path, name="parquet", paths=[str(p)]), 0)  # an empty cell is no document
    assert "skipped" not in ok.description
    q = tmp_path / "e.parquet"
    pq.write_table(pa.table({"text": pa.array([[1, 2], [3]] + [[4]] * 6)}), q)
    with pytest.raises(UserError, match=r"e\.parquet: row 0: data\.text_field 'text' holds list"):
        load_corpus(cfg(tmp_path, name="parquet", paths=[str(q)]), 0)


def test_fine_tuning_skips_by_default_and_errors_when_asked(tmp_path: Path) -> None:
    p = lines(
        tmp_path / "sft.jsonl",
        *[b'{"prompt": "q%d", "response": "an answer"}' % i for i in range(8)],
        b'{"prompt": "\xc3(", "response": "b"}',
    )
    base = {"name": "jsonl", "format": "instruction", "paths": [str(p)], "seq_len": 64}
    with pytest.warns(UserWarning, match=r"skipped 1 of 9 records .*sft\.jsonl:9: invalid UTF-8"):
        preflight(cfg(tmp_path, **base))
    with pytest.raises(UserError, match=r"^.*sft\.jsonl:9: invalid UTF-8 at byte 12 \(data\.bad_records"):
        preflight(cfg(tmp_path, **base, bad_records="error"))


def test_the_setting_is_checked_at_load(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data\.bad_records"):
        cfg(tmp_path, bad_records="ignore")


def test_zoff_train_names_a_bad_pretraining_line_before_any_rank_starts(tmp_path: Path) -> None:
    """The pre-flight tokenizes pretraining text once (the ranks read its cache): a bad line is one line,
    exit 2, and no run directory."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    _, mixed = good_and_bad(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "train", str(repo / "configs" / "tiny.yaml"), "data.name=jsonl",
         f"data.paths=[{mixed}]", f"data.cache_dir={tmp_path / 'cache'}", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "mixed.jsonl:2: invalid UTF-8 at byte 13" in lines[0], (
        p.stderr
    )
    assert not (tmp_path / "run").exists()
