"""Shared pytest fixtures (keep this light: imported by every test module)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DISK = Path(os.environ.get("ZOFF_TEST_NVME_DIR", "/var/tmp"))  # a real disk: /tmp may be tmpfs elsewhere


def pytest_configure(config: pytest.Config) -> None:
    """The sources byte-compiled once (_compile_sources). Under pytest-xdist (the README's `-n 2`) each worker
    computes on one thread: two workers share the two cores, and a second torch thread per worker only spins
    against the other worker's ranks. Ranks set their own threads (the launcher, tests.harness); this is the
    test process's in-process work."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    else:  # (once, before any worker starts)
        _compile_sources()


def _compile_sources() -> None:
    """Byte-compile zoff/, scripts/ and tests/ once: where PYTHONDONTWRITEBYTECODE is set (this project's
    machines set it) no import keeps what it compiled, so every fresh interpreter the suite starts (each
    `zoff train`'s launcher and rank server, the scripts, the fresh CLI calls) compiled zoff again, ~0.35 s
    each. Python still reads the files compileall writes. A read-only checkout just compiles as before."""
    import compileall

    for folder in ("zoff", "scripts", "tests"):
        compileall.compile_dir(REPO_ROOT / folder, quiet=2)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository checkout (holds zoff/, configs/, recipes/, tests/)."""
    return REPO_ROOT


@pytest.fixture
def agents():
    """Real `zoff train` launchers a test starts (tests/processes.Agent); whatever is left of them is killed
    afterwards."""
    from tests.processes import Agent

    started: list = []

    def start(*args, **kw):
        a = Agent(*args, **kw)
        started.append(a)
        return a

    yield start
    for a in started:
        a.cleanup()


@pytest.fixture
def swap(tmp_path: Path):
    """A fresh folder for disk-tier swap files on the real disk (tmp_path when there is none), removed
    afterwards."""
    where = Path(tempfile.mkdtemp(prefix="zoff-test-", dir=DISK)) if DISK.is_dir() else tmp_path / "swap"
    yield where
    shutil.rmtree(where, ignore_errors=True)
