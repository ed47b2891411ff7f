"""The compiled CPU Adam is code: loaded only from a folder this user owns that nobody else can write, and only
the library whose sha256 its build recorded (issue 33: anyone who could write ZOFF_CACHE_DIR ran code)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zoff.host.cache import private_dir
from zoff.optim import cpu_adam

REASON = "from zoff.optim import backend_info; print(backend_info()['reason'])"


def test_a_cache_writable_by_others_is_not_loaded_from(tmp_path: Path) -> None:
    ext = tmp_path / "ext"
    ext.mkdir()
    os.chmod(ext, 0o777)  # a shared scratch folder anyone can write
    p = subprocess.run(
        [sys.executable, "-c", REASON], capture_output=True, text=True, env={**os.environ, "ZOFF_CACHE_DIR": str(tmp_path)}
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "writable by others (mode 777)" in p.stdout and "using the PyTorch fallback" in p.stderr
    assert not any(ext.rglob("*.so"))  # nothing was built there either


def test_private_dir_makes_0700_and_names_each_problem(tmp_path: Path) -> None:
    made = tmp_path / "a" / "b"
    assert private_dir(made) is None and (made.stat().st_mode & 0o777) == 0o700
    link = tmp_path / "link"
    link.symlink_to(made)
    assert "is a link" in private_dir(link)
    os.chmod(made, 0o775)
    assert "writable by others (mode 775)" in private_dir(made)


def test_a_library_other_than_the_recorded_one_is_not_imported(tmp_path: Path) -> None:
    if cpu_adam._extension() is None:
        pytest.skip("no compiled kernel on this machine")
    built = Path(cpu_adam._state["build_dir"])
    copy = tmp_path / "ext" / built.name
    shutil.copytree(built, copy)
    lib = copy / f"{cpu_adam._NAME}.so"
    assert cpu_adam.verified_library(copy) == lib  # the recorded library passes (not imported twice here)
    lib.write_bytes(lib.read_bytes() + b"\0")  # swapped by someone else
    with pytest.raises(ImportError, match="sha256 differs"):
        cpu_adam.verified_library(copy)
