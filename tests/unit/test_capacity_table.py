"""The capacity table (docs/memory-estimates.md) is rendered from docs/results/capacity.json (scripts/capacity_table.py): it
cannot drift from its measurement, and a changed number in the JSON makes this test fail."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("capacity_table", REPO / "scripts" / "capacity_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_estimates_page_embeds_the_table_rendered_from_its_json() -> None:
    ct = _script()
    data = json.loads(ct.JSON.read_text())
    assert data["date"] and data["commit"] and data["machine"]
    table = ct.render(data)
    assert table in (REPO / "docs" / "memory-estimates.md").read_text()
    changed = copy.deepcopy(data)
    rows = changed["boxes"][0]["policies"]
    fit = next(p for p in rows if p["name"] == "zero3-offload" and p["activation_checkpointing"])["largest"]
    fit["gpu_bytes"] += 2**30
    assert ct.render(changed) not in (REPO / "docs" / "memory-estimates.md").read_text()


@pytest.mark.grid  # (about a minute: four boxes of --max-model with the stage-3 fallbacks, and a context column)
def test_the_json_is_what_the_estimate_computes_now() -> None:
    """The figures are today's estimate: an engine or estimate change that moves them must re-run the script."""
    ct = _script()
    want = json.loads(ct.JSON.read_text())
    got = ct.compute()
    assert [b["policies"] for b in got["boxes"]] == [b["policies"] for b in want["boxes"]]
    assert got["context"] == want["context"]
