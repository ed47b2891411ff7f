"""The ranks' stop record (trainer/nonfinite.py) is read back from the run directory by `zoff train`, which
others may have written to: garbage in it is no stop, and clearing it removes a planted link, not its target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zoff.trainer.nonfinite import STOP_FILE, clear_stop, note_stop, recorded_stop


def test_the_record_round_trips_once(tmp_path: Path) -> None:
    note_stop(tmp_path, 7, "3 steps in a row")
    assert recorded_stop(tmp_path) == {"step": 7, "reason": "3 steps in a row"}
    assert recorded_stop(tmp_path) is None  # forgotten once read


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "[1, 2]",
        json.dumps({"step": 3}),
        json.dumps({"reason": {"code": "x"}}),
        "\x00" * 64,
        json.dumps({"reason": "x" * (1 << 20)}),
    ],
)
def test_garbage_in_the_record_is_no_stop(tmp_path: Path, text: str) -> None:
    (tmp_path / STOP_FILE).write_text(text)
    assert recorded_stop(tmp_path) is None


def test_clearing_removes_a_planted_link_and_leaves_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's data\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / STOP_FILE).symlink_to(victim)
    clear_stop(run)
    assert not (run / STOP_FILE).exists() and not (run / STOP_FILE).is_symlink()
    assert victim.read_text() == "someone else's data\n"
