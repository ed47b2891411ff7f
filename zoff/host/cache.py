"""Where zoff caches what it builds (tokenized corpora, the compiled CPU Adam): one rule, read here only."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def cache_dir() -> Path:
    """$ZOFF_CACHE_DIR, else $XDG_CACHE_HOME/zoff, else ~/.cache/zoff; callers add their own subfolder."""
    if os.environ.get("ZOFF_CACHE_DIR"):
        return Path(os.environ["ZOFF_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zoff"


def private_dir(path: Path) -> str | None:
    """Make `path` (0700, parents too) if missing; then why it is no place to load code from, or None: it must
    be a real folder (not a link) owned by this user that no one else can write, and so must its parent
    (whoever can write either could swap in their own files)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in (path, path.parent):
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            return f"{d} is a link or not a folder"
        if st.st_uid != os.getuid():
            return f"{d} belongs to another user (uid {st.st_uid})"
        if st.st_mode & 0o022:
            return f"{d} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None
