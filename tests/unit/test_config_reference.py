"""The config reference comes from the schema (zoff/config/reference.py, issue 36 item 1): every key of the
dataclasses is in docs/configuration.md with its type, default, range and meaning, the page is what the
schema renders, and `zoff validate --explain KEY` prints the same entry."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from zoff.config import Config, config_from_dict
from zoff.config.reference import explain, keys, markdown
from zoff.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _leaves(cls: type = Config, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        out += _leaves(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{f.name}"]
    return out


def test_every_key_of_the_schema_is_in_the_reference_with_a_meaning() -> None:
    got = {k.path: k for k in keys()}
    assert list(got) == _leaves()
    assert not [p for p, k in got.items() if not k.meaning], "every key says what it is for (a field comment)"


def test_defaults_and_ranges_are_the_schemas() -> None:
    got = {k.path: k for k in keys()}
    d = config_from_dict({})
    assert got["train.max_steps"].default == str(d.train.max_steps) == "200"
    assert got["data.max_line_bytes"].default == "16777216 (16 MiB)"
    assert got["zero.stage"].range == "0 <= x <= 3"
    assert got["optim.lr"].range == "0 < x"
    assert got["model.d_model"].range == "1 <= x <= 2^18"
    assert got["data.bad_records"].type == "auto \\| error \\| skip"
    # The meaning is the field's comment, continuation lines included.
    assert got["launch.timeout_s"].meaning == "a collective waiting longer is an error"
    assert got["zero.offload_param.io.threads"].meaning == "requests in flight per swap file"  # inherited


def test_the_page_is_what_the_schema_renders() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    start = page.index("<!-- render: config_reference -->\n") + len("<!-- render: config_reference -->\n")
    assert page[start : page.index("<!-- /render -->", start)] == markdown().rstrip("\n") + "\n"


def test_explain_prints_one_key_or_a_section() -> None:
    one = explain("train.grad_clip")
    assert one == "train.grad_clip: float (default 1.0, 0 <= x): 0 disables clipping\n"
    section = explain("zero.offload_param.io")
    assert section.splitlines()[0].startswith("zero.offload_param.io: The disk tier's I/O")
    assert len(section.splitlines()) == 3
    with pytest.raises(
        ConfigError,
        match=r"^unknown key zero\.hostbudget \(did you mean 'zero\.offload_optimizer\.host_budget'\?\)$",
    ):
        explain("zero.hostbudget")


def test_zoff_validate_explain(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "zoff", "validate", "--explain", "data.bad_records"],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("data.bad_records: auto | error | skip (default auto): ")
    bad = subprocess.run([sys.executable, "-m", "zoff", "validate", "--explain", "nope.key"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["zoff: error: unknown key nope.key"]
