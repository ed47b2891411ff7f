"""Shared pytest fixtures (keep this light: imported by every test module)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository checkout (holds zoff/, configs/, recipes/, tests/)."""
    return REPO_ROOT
