"""`zoff --help` and every command's `--help` end with example command lines, and the examples name only
commands, flags and shipped configs that exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zoff.cli import app

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["train", "validate", "estimate", "convert", "doctor", "ls", "cp", "plot", "bench-io"]


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def _examples(text: str) -> list[list[str]]:
    tail = text.rstrip().split("Examples:")[-1]
    return [shlex.split(line) for line in tail.strip().splitlines()]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_ends_with_examples(command: str | None) -> None:
    text = _help(*([command] if command else []))
    examples = _examples(text)
    assert "Examples:" in text and 1 <= len(examples) <= 3, text
    for words in examples:
        assert words[0] == "zoff" and words[1] in COMMANDS, words
        if command:
            assert words[1] == command, words
        flags = set(re.findall(r"--[a-z][\w-]*", _help(words[1])))
        assert {w for w in words if w.startswith("--")} <= flags, words
        assert all((REPO / w).exists() for w in words if w.startswith("configs/")), words
