"""Where zoff caches what it builds (tokenized corpora, the compiled CPU Adam): one rule, read here only."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$ZOFF_CACHE_DIR, else $XDG_CACHE_HOME/zoff, else ~/.cache/zoff; callers add their own subfolder."""
    if os.environ.get("ZOFF_CACHE_DIR"):
        return Path(os.environ["ZOFF_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zoff"
