"""Every policy `zoff estimate` prints is a value `zero=` accepts (issue 68, item 2): at 51a0203
`zero=zero3-offload-opt` (the estimate's suggestion for the README's 70B example) was "unknown recipe", and so
were zero1-offload, zero1-nvme and zero3-nvme-opt+param-cpu. A copied recipe (`zoff cp`) is a value too, and
`zoff cp` says how to use it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zoff.config import ConfigError, load_config
from zoff.engine.policy import POLICIES, Policy

REPO = Path(__file__).resolve().parents[2]
NAMES = sorted({p.name for p in POLICIES})


@pytest.mark.parametrize("name", NAMES)
def test_each_policy_name_is_a_recipe_of_that_policy(name: str, tmp_path) -> None:
    disk = [f"zero.offload_optimizer.nvme_path={tmp_path}"] if "nvme" in name else []
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"zero={name}", *disk])
    assert Policy.of(cfg.zero).name == name


def _zoff(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zoff", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_a_copied_recipe_is_used_as_zoff_cp_says(tmp_path) -> None:
    out = _zoff("cp", "zero3-offload", "mine.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = out.stdout.splitlines()
    assert said[0] == "zoff: wrote mine.yaml"
    use = said[1].strip().removeprefix("use it: ").split("   ")[0]
    assert use == "zoff train CONFIG zero=mine.yaml"
    argv = use.replace("CONFIG", str(REPO / "configs" / "tiny.yaml")).split()[1:]
    out = _zoff("validate" if argv[0] == "train" else argv[0], *argv[1:], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"zero={tmp_path / 'mine.yaml'}"])
    assert Policy.of(cfg.zero).name == "zero3-offload"


def test_a_recipe_file_that_is_not_there_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^zero: recipe file 'nowhere/r.yaml' not found"):
        load_config(REPO / "configs" / "tiny.yaml", ["zero=nowhere/r.yaml"])
