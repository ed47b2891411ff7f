"""Fuzzing of the files zoff reads from other people (issue 33): safetensors headers (checkpoint shards and
Hugging Face weights share zoff.files.tensorfile's reader) and data files (JSON Lines for pretraining and for
fine-tuning, in both data.bad_records modes).

Deterministic (random.Random(SEED)). Every case either reads — and then every tensor reads whole at the shape
its header gives, or the corpus has tokens — or ends in one zoff UserError of one line naming the file: never
another exception, never a hang, never a tensor whose bytes and shape disagree."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from tests.datafiles import DOCS
from zoff.config import config_from_dict
from zoff.data import load_corpus, preflight
from zoff.errors import UserError
from zoff.files.tensorfile import SafetensorsReader, write_streaming

SEED = 20261126
N_HEADER_CASES = 300
N_DATA_CASES = 160

# ------------------------------------------------------------------------------------- safetensors headers

TENSORS = {
    "a.weight": torch.arange(12, dtype=torch.float32).view(3, 4),
    "b.bias": torch.arange(5, dtype=torch.bfloat16),
    "c.ids": torch.arange(6, dtype=torch.int64).view(1, 2, 3),
    "scalar": torch.tensor(7.0, dtype=torch.float16),
}
BAD_VALUES = [
    None, True, -1, 2**64, 1.5, "3", "", [], {}, [-1], [1.5], ["2"], [True, 1], [2**62, 2**62], [0, 1, 2],
    [10**30], list(range(100)), "F32", "X99", ["F32"], {"dtype": "F32"}, [[1]], "\u0000", "é" * 50,
]  # fmt: skip


def _valid_file(path: Path) -> bytes:
    layout = [(k, list(t.shape), t.dtype) for k, t in TENSORS.items()]
    write_streaming(path, layout, TENSORS.items())
    return path.read_bytes()


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join(header: object, data: bytes, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _mutate_header(rng: random.Random, blob: bytes) -> bytes:
    header, data = _split(blob)
    key = rng.choice(list(TENSORS))
    kind = rng.randrange(12)
    if kind == 0:  # one field of one tensor replaced by a bad value
        header[key][rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(BAD_VALUES)
    elif kind == 1:  # one field removed
        header[key].pop(rng.choice(["dtype", "shape", "data_offsets"]))
    elif kind == 2:  # a shape that no longer matches its bytes
        header[key]["shape"] = [rng.randrange(0, 50) for _ in range(rng.randrange(0, 4))]
    elif kind == 3:  # offsets moved, swapped or past the end
        lo, hi = header[key]["data_offsets"]
        header[key]["data_offsets"] = rng.choice(
            [[hi, lo], [lo, hi + rng.randrange(1, 10**6)], [lo + 1, hi + 1]]
        )
    elif kind == 4:  # another dtype with the same bytes
        header[key]["dtype"] = rng.choice(["F64", "I8", "U8", "BOOL", "F8_E4M3", "I16", "C64", "f32"])
    elif kind == 5:  # the entry replaced wholesale
        header[key] = rng.choice(BAD_VALUES)
    elif kind == 6:  # the header is not an object
        header = rng.choice([[1, 2], "x", 3, None, True])
    elif kind == 7:  # nested past the parser's depth
        return _join(None, data, b"[" * 5000 + b"]" * 5000)
    elif kind == 8:  # the length field
        n = rng.choice([0, 1, 7, len(blob), 2**63, 2**64 - 1, rng.randrange(1, 200)])
        return n.to_bytes(8, "little") + blob[8:]
    elif kind == 9:  # bytes of the header flipped
        raw = bytearray(blob)
        n = int.from_bytes(blob[:8], "little")
        for _ in range(rng.randint(1, 4)):
            raw[8 + rng.randrange(n)] ^= 1 << rng.randrange(8)
        return bytes(raw)
    elif kind == 10:  # cut anywhere
        return blob[: rng.randrange(len(blob))]
    else:  # a __metadata__ of any shape, and a tensor named like it
        header["__metadata__"] = rng.choice(BAD_VALUES)
        header[rng.choice(["__metadata", "", "é", "../x"])] = header[key]
    return _join(header, data)


def _header_cases() -> list[tuple[int, random.Random]]:
    return [(i, random.Random(f"{SEED}-header-{i}")) for i in range(N_HEADER_CASES)]


def test_every_mutated_safetensors_header_reads_consistently_or_is_one_line(tmp_path: Path) -> None:
    good = _valid_file(tmp_path / "good.safetensors")
    outcomes = {"read": 0, "refused": 0}
    for i, rng in _header_cases():
        p = tmp_path / f"case{i}.safetensors"
        p.write_bytes(_mutate_header(rng, good))
        try:
            r = SafetensorsReader(p)
        except UserError as e:
            msg = str(e)
            assert "\n" not in msg and str(p) in msg, (i, msg)
            outcomes["refused"] += 1
            continue
        try:
            for k in r.keys():  # what opens must read whole, at the shape and dtype its header gives
                t = r.read(k)
                assert list(t.shape) == r.shape(k) and t.dtype == r.dtype(k), (i, k)
        finally:
            r.close()
        outcomes["read"] += 1
    # Both outcomes occur (a metadata edit or a dtype of the same width reads): the cases are not all one kind.
    assert outcomes["read"] >= 10 and outcomes["refused"] >= 200, outcomes


def test_a_shape_that_does_not_fill_its_bytes_is_refused_at_open(tmp_path: Path) -> None:
    header, data = _split(_valid_file(tmp_path / "g.safetensors"))
    header["a.weight"]["shape"] = [2, 4]  # 32 of its 48 bytes
    p = tmp_path / "bad.safetensors"
    p.write_bytes(_join(header, data))
    with pytest.raises(
        UserError, match=r"bad\.safetensors: corrupted safetensors header \(tensor 'a\.weight': shape"
    ):
        SafetensorsReader(p)


# -------------------------------------------------------------------------------------------- data files

LINE_EDITS = [
    b"", b"\r", b"\x00" * 10, b"\xef\xbb\xbf{}", b'{"text": 5}', b'{"text": null}', b'{"text": ["a"]}',
    b'{"text": {"a": 1}}', b"[" * 2000, b'{"text": "' + b"z" * 5000 + b'"}', b'{"text": "\xed\xa0\x80"}',
    b'{"prompt": 1, "response": "x"}', b'{"prompt": "q", "response": ""}', b'{"messages": "hi"}', b"null", b"1e999",
    b'{"text": "ok", "text": 3}', b'"just a string"', b'{"prompt": "q", "response": "\\ud800"}',
]  # fmt: skip


def _records(fmt: str) -> list[bytes]:
    if fmt == "text":
        return [json.dumps({"text": d}).encode() for d in DOCS[:12]]
    return [json.dumps({"prompt": f"q{i}", "response": d}).encode() for i, d in enumerate(DOCS[:12])]


def _mutate_data(rng: random.Random, lines: list[bytes]) -> bytes:
    lines = list(lines)
    for _ in range(rng.randint(1, 4)):
        i, kind = rng.randrange(len(lines)), rng.randrange(5)
        if kind == 0:
            lines[i] = rng.choice(LINE_EDITS)
        elif kind == 1:
            lines.insert(i, rng.randbytes(rng.randrange(1, 300)))
        elif kind == 2:  # bits flipped inside a line
            b = bytearray(lines[i])
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            lines[i] = bytes(b)
        elif kind == 3:
            lines = lines[: i + 1]
        else:
            lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
    return b"\n".join(lines) + rng.choice([b"\n", b"", b"\r\n"])


@pytest.mark.parametrize("fmt", ["text", "instruction"])
def test_every_mutated_data_file_loads_or_is_one_line(tmp_path: Path, fmt: str) -> None:
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(N_DATA_CASES):
        rng = random.Random(f"{SEED}-data-{fmt}-{i}")
        p = tmp_path / f"case{i}.jsonl"
        p.write_bytes(_mutate_data(rng, _records(fmt)))
        mode = rng.choice(["auto", "error", "skip"])
        data = {"name": "jsonl", "paths": [str(p)], "format": fmt, "bad_records": mode, "seq_len": 16,
                "max_line_bytes": 4096, "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.2}  # fmt: skip
        cfg = config_from_dict({"data": data}).data
        try:
            if fmt == "text":
                c = load_corpus(cfg, 0)
                assert len(c.train) > 0 and len(c.val) > 0
            else:
                with warnings.catch_warnings():  # skipped records are warned of: an outcome, not a failure
                    warnings.simplefilter("ignore")
                    preflight(cfg)
        except UserError as e:
            msg = str(e)
            assert "\n" not in msg and (str(p) in msg or "data" in msg), (i, msg)
            outcomes["refused"] += 1
            continue
        outcomes["loaded"] += 1
    assert outcomes["loaded"] >= 10 and outcomes["refused"] >= 10, outcomes
