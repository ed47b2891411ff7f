"""Shared pytest fixtures (keep this light: imported by every test module)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


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
