"""A YAML alias bomb (issue 33): nine nested aliases of nine references each expand 500 bytes into hundreds of
millions of values. A config, and a checkpoint's config.yaml read by `zoff convert`, are refused in one line
as soon as they expand past MAX_YAML_VALUES, instead of hanging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zoff.config import MAX_YAML_VALUES, read_yaml_text
from zoff.errors import UserError

BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefg", "bcdefgh"))
    + "model: {args: {bomb: *h}}\n"
)


def test_an_alias_bomb_is_refused_in_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(BOMB)
    assert len(BOMB) < 600
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "validate", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"zoff: error: {cfg}: YAML expands to more than {MAX_YAML_VALUES:,} values (aliases repeated?)"
    ]


def test_a_checkpoints_config_is_read_with_the_same_bound(tmp_path: Path) -> None:
    source = tmp_path / "config.yaml"  # (zoff convert reads a checkpoint's config.yaml through this)
    source.write_text(BOMB)
    with pytest.raises(UserError, match="YAML expands to more than"):
        read_yaml_text(source, source.read_text)
    source.write_text("model: {args: {ok: &x [1, 2], again: *x}}\n")  # aliases within reason are fine
    assert read_yaml_text(source, source.read_text)["model"]["args"]["again"] == [1, 2]
