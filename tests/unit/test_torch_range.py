"""The torch range is one fact: zoff/host/versions.py states it, docs/results/torch_range.json (what
scripts/torch_range.py ran) backs it, pyproject.toml requires its lower bound, and `zoff doctor` shows it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoff.host import versions

REPO = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("torch_range", REPO / "scripts" / "torch_range.py")
TR = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TR)


def _entry(torch_version: str, **over) -> dict:
    entry = {
        "torch": torch_version.split("+")[0],
        "torch_version": torch_version,
        "build": "cpu",
        "python": "3.11.7",
        "suite": "quick",
        "date": "2026-11-26T09:00:00+00:00",
        "commit": "abc1234",
        "install": {"ok": True, "seconds": 60.0, "venv_gib": 1.1, "error": None},
        "quickstart": {
            "ok": True,
            "seconds": 80.0,
            "final_loss": 2.31,
            "final_val_loss": 2.44,
            "near_readme": True,
        },
        "tests": {
            "passed": 500,
            "failed": 0,
            "skipped": 3,
            "errors": 0,
            "seconds": 400.0,
            "timed_out": False,
            "first_failures": [],
        },
        "warnings": [],
    }
    entry.update(over)
    return entry


def test_render_makes_one_row_per_version_with_failures_and_warnings_below() -> None:
    one_failure = {"passed": 9, "failed": 1, "skipped": 0, "errors": 0, "seconds": 12.0, "timed_out": False}
    data = TR.merge(
        {"versions": {"2.15.0": _entry("2.15.0", build="cu130")}},
        {
            "2.12.0": _entry(
                "2.12.0+cpu",
                tests={**one_failure, "first_failures": ["tests/unit/test_x.py::test_y"]},
                warnings=[{"where": "zoff/a.py:3", "category": "FutureWarning", "message": "old | new"}],
            )
        },
    )
    assert list(data["versions"]) == ["2.12.0", "2.15.0"]  # merged, in release order
    md = TR.render(data)
    rows = [ln for ln in md.splitlines() if ln.startswith("| 2.")]
    assert len(rows) == 2
    assert rows[0].startswith(
        "| 2.12.0+cpu | cpu | 3.11.7 | ok | 2.31 (2.44), 80 | quick | 9 | 1 | 0 | 0 | 12 | 1 | FAIL |"
    )
    assert rows[1].startswith(
        "| 2.15.0 | cu130 | 3.11.7 | ok | 2.31 (2.44), 80 | quick | 500 | 0 | 3 | 0 | 400 | 0 | pass |"
    )
    assert "2.12.0 failures: `tests/unit/test_x.py::test_y`" in md
    assert "`zoff/a.py:3` FutureWarning: old \\| new" in md  # a | in a message does not split the row
    assert TR.passed(data) == ["2.15.0"]


def test_a_failure_on_every_version_is_the_trees_not_torchs() -> None:
    fail = {"passed": 9, "failed": 1, "skipped": 0, "errors": 0, "seconds": 12.0, "timed_out": False}
    both = {"first_failures": ["tests/unit/test_x.py::test_y"]}
    data = {"versions": {v: _entry(v, tests={**fail, **both}) for v in ("2.12.0", "2.13.0")}}
    assert TR.passed(data) == ["2.12.0", "2.13.0"]
    assert "failing on every version" in TR.render(data) and "2.12.0 failures" not in TR.render(data)
    data["versions"]["2.13.0"]["tests"]["first_failures"] = []  # fails on 2.12.0 only: 2.12.0's
    data["versions"]["2.13.0"]["tests"]["failed"] = 0
    assert TR.passed(data) == ["2.13.0"]
    data["versions"]["2.13.0"]["quickstart"]["near_readme"] = False  # the quickstart's loss counts too
    assert TR.passed(data) == []


def test_render_says_what_did_not_run() -> None:
    bad = _entry("2.16.0", install={"ok": False, "error": "No matching distribution found for torch==2.16.0"})
    del bad["quickstart"], bad["tests"]
    md = TR.render({"versions": {"2.16.0": bad}})
    assert "| failed | not run | quick | - | - | - | - | - | 0 | FAIL |" in md
    assert "2.16.0 install: No matching distribution" in md


def test_pytest_output_is_read_for_counts_failures_and_zoff_warnings(tmp_path: Path) -> None:
    src = tmp_path / "src"
    out = f"""..F.s
=============================== warnings summary ===============================
tests/unit/test_a.py::test_b
  {src}/zoff/engine/x.py:12: FutureWarning: `torch.foo` is deprecated
  {src}/zoff/engine/x.py:12: FutureWarning: `torch.foo` is deprecated
  /v/lib/python3.11/site-packages/torch/y.py:5: DeprecationWarning: inside torch
  {src}/zoff/engine/x.py:40: UserWarning: not a deprecation
FAILED tests/unit/test_a.py::test_c[1] - AssertionError
ERROR tests/integration/test_d.py::test_e - RuntimeError
1 failed, 3 passed, 1 skipped, 1 error, 4 warnings in 12.50s
"""
    assert TR.pytest_counts(out) == {"passed": 3, "failed": 1, "skipped": 1, "errors": 1}
    assert TR.first_failures(out) == [
        "tests/unit/test_a.py::test_c[1]",
        "tests/integration/test_d.py::test_e",
    ]
    mine, other = TR.zoff_warnings(out, src)
    assert mine == [
        {"where": "zoff/engine/x.py:12", "category": "FutureWarning", "message": "`torch.foo` is deprecated"}
    ]
    assert [w["where"] for w in other] == ["torch/y.py:5"]


def test_bad_cli_input_is_one_line_and_exit_2() -> None:
    for args in (["2.13"], [], ["2.15.0", "--root", str(REPO / "tests")], ["2.15.0", "--suite", "all"]):
        p = subprocess.run(
            [sys.executable, "scripts/torch_range.py", *args], cwd=REPO, capture_output=True, text=True
        )
        assert p.returncode == 2, (args, p.stderr)
        assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)


def test_the_checked_releases_are_those_that_passed_in_the_json() -> None:
    data = json.loads(TR.JSON.read_text())
    assert list(versions.TORCH_CHECKED_CPU) == TR.passed(data), (
        "zoff/host/versions.py's TORCH_CHECKED_CPU and docs/results/torch_range.json differ"
    )
    newest = max(versions._minor(v) for v in versions.TORCH_CHECKED_CPU)
    assert versions._minor(versions.TORCH_CHECKED_BELOW) == (newest[0], newest[1] + 1)


def test_pyproject_requires_the_lower_bound_and_the_gpu_check_runs_it() -> None:
    req = re.search(r'^\s*"torch([<>=!~][^"]*)",', (REPO / "pyproject.toml").read_text(), re.M)[1]
    assert req.split(",")[0] == f">={versions.TORCH_REQUIRED}", req
    assert all(
        versions._minor(v) == versions._minor(versions.TORCH_REQUIRED) for v in versions.TORCH_CHECKED_GPU
    )
    assert any(f"torch {v}" in (REPO / "docs" / "gpus.md").read_text() for v in versions.TORCH_CHECKED_GPU)
    pyproject = (REPO / "pyproject.toml").read_text()  # its comment names the checked releases too
    assert all(v in pyproject for v in versions.TORCH_CHECKED_CPU + versions.TORCH_CHECKED_GPU)


@pytest.mark.parametrize(
    "version,says",
    [
        ("2.10.1", "older than zoff needs"),
        ("2.11.0+cu130", "checked by the GPU check only"),
        ("2.13.0+cpu", "checked on the CPU"),
        ("2.12.1", "its series was, on 2.12.0"),
        ("2.16.0a0+git1234", "newer than any checked"),
        ("3.0.0", "newer than any checked"),
    ],
)
def test_torch_status(version: str, says: str) -> None:
    assert versions.torch_status(version).startswith(f"{version}: ") and says in versions.torch_status(
        version
    )


def test_doctor_names_the_installed_torch_and_the_range() -> None:
    env = {**os.environ, "ZOFF_CPU_ADAM_BACKEND": "torch"}  # no extension build: this test is about torch
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "doctor"], cwd=REPO, capture_output=True, text=True, env=env
    )
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["torch"] == torch.__version__
    assert report["torch_status"].startswith(f"{torch.__version__}: ")
    assert report["torch_checked"] == versions.checked_range()
    assert f"torch>={versions.TORCH_REQUIRED}" in report["torch_checked"]
    assert all(v in report["torch_checked"] for v in versions.TORCH_CHECKED_CPU + versions.TORCH_CHECKED_GPU)


def test_a_pip_conflict_is_reported_by_who_asked_for_what() -> None:
    out = """ERROR: Cannot install zoff because these package versions have conflicting dependencies.

The conflict is caused by:
    zoff 0.1.0 depends on torch>=2.11
    The user requested (constraint) torch==2.12.0+cu130

To fix this you could try to:
1. loosen the range of package versions you've specified
ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/
"""
    assert TR.pip_error(out) == (
        "zoff 0.1.0 depends on torch>=2.11 / The user requested (constraint) torch==2.12.0+cu130"
    )
    assert TR.pip_error("ERROR: No matching distribution found for torch==2.16.0\n") == (
        "ERROR: No matching distribution found for torch==2.16.0"
    )
