"""JSON Lines as untrusted input (zoff/data/jsonl.py, issue 33): an overlong line is skipped without being held,
invalid UTF-8 and JSON nested past the parser's depth are bad lines, named, never repaired or a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zoff.data.jsonl import Bad, jsonl
from zoff.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def _file(tmp_path: Path, *lines: bytes) -> Path:
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


def test_each_kind_of_bad_line_is_named_and_the_next_line_still_reads(tmp_path: Path) -> None:
    p = _file(
        tmp_path,
        b'{"text": "ok"}',
        b'{"text": "' + b"x" * 10_000 + b'"}',  # over the cap
        b'{"text": "caf\xe9"}',  # Latin-1, not UTF-8
        b"[" * 3000 + b"]" * 3000,  # deeper than json's recursion limit (1000)
        b"{not json",
        b"",
        b'{"text": "after"}',
    )
    got = list(jsonl(p, max_line_bytes=8192))
    assert [n for n, _ in got] == [1, 2, 3, 4, 5, 7]
    assert got[0][1] == {"text": "ok"} and got[-1][1] == {"text": "after"}
    bad = [obj for _, obj in got[1:5]]
    assert all(isinstance(b, Bad) for b in bad)
    assert bad[0] == "line longer than data.max_line_bytes (8.0 KiB)"
    assert bad[1] == "invalid UTF-8 at byte 13"
    assert bad[2] == "JSON nested too deep"
    assert bad[3].startswith("not valid JSON")


def test_an_overlong_line_is_never_held_whole(tmp_path: Path, monkeypatch) -> None:
    """Skipped in CHUNK reads: no read returns more than the cap (+1) or a chunk."""
    import zoff.data.jsonl as mod

    p = _file(tmp_path, b'{"text": "' + b"y" * (3 << 20) + b'"}', b'{"text": "next"}')
    monkeypatch.setattr(mod, "CHUNK", 4096)
    sizes = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def readline(self, n):
            line = self.f.readline(n)
            sizes.append(len(line))
            return line

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(mod, "open", lambda path, mode: Spy(real_open(path, mode)), raising=False)
    got = list(jsonl(p, max_line_bytes=2048))
    assert got[1] == (2, {"text": "next"}) and isinstance(got[0][1], Bad)
    assert max(sizes) <= 4096


def test_pretraining_text_stops_on_a_bad_line_naming_it(tmp_path: Path) -> None:
    from zoff.config import config_from_dict
    from zoff.data.sources import _jsonl

    p = _file(tmp_path, b'{"text": "fine"}', b'{"text": "\xff\xfe"}')
    cfg = config_from_dict({"data": {"name": "jsonl", "paths": [str(p)]}}).data
    with pytest.raises(UserError, match=r"d\.jsonl:2: invalid UTF-8 at byte 10 \(data.bad_records: skip"):
        list(_jsonl(cfg, p))


def test_fine_tuning_counts_bad_lines_as_bad_records(tmp_path: Path) -> None:
    from zoff.config import config_from_dict
    from zoff.data.records import BadRecord, read_records

    p = _file(tmp_path, b'{"prompt": "a", "response": "b"}', b'{"prompt": "\xc3(", "response": "b"}')
    cfg = config_from_dict({"data": {"name": "jsonl", "format": "instruction", "paths": [str(p)]}}).data
    recs = list(read_records(cfg, [p]))
    assert recs[0][1] == {"prompt": "a", "response": "b"}
    assert (
        isinstance(recs[1][1], BadRecord) and "invalid UTF-8" in str(recs[1][1]) and recs[1][0].endswith(":2")
    )


def test_the_cap_is_a_config_key_with_bounds(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "validate", str(REPO / "configs" / "tiny.yaml"), "data.max_line_bytes=10"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert p.returncode == 2 and "data.max_line_bytes" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_a_corrupt_tokenizer_folder_is_one_line(tmp_path: Path) -> None:
    """tokenizers raises a bare Exception on a damaged tokenizer.json: zoff names the key and the folder."""
    pytest.importorskip("tokenizers")
    from zoff.data.tokenize import load_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"garbage": ')
    with pytest.raises(UserError, match=r"^data\.tokenizer: .*: cannot load its tokenizer \(expected"):
        load_tokenizer(str(tmp_path))


def test_an_escaped_lone_surrogate_is_a_bad_line_and_a_pair_is_text(tmp_path: Path) -> None:
    """json.loads turns "\\ud800" into a str that cannot be encoded: a crash in tokenization, found by fuzzing."""
    p = _file(tmp_path, b'{"text": "a\\ud800b"}', b'{"text": "\\ud83d\\ude00 ok"}', b'{"t": ["\\uDFFF"]}')
    got = list(jsonl(p, max_line_bytes=1024))
    assert isinstance(got[0][1], Bad) and "lone UTF-16 surrogate" in got[0][1]
    assert got[1][1] == {"text": "\U0001f600 ok"}
    assert isinstance(got[2][1], Bad)
