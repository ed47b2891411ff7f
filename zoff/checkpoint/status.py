"""What a checkpoint directory holds right now, for the launcher's final message after a stop or a failure.

The launcher reads the directory once before the ranks start and once after they are gone, and compares:
a latest checkpoint that is not the one it found at start was saved by this run, and its manifest says
whether it was saved for a stop. Nothing is taken from what the ranks or the signals were meant to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from zoff.checkpoint.format import find_checkpoint, read_manifest
from zoff.errors import UserError


@dataclass(frozen=True)
class OnDisk:
    """The checkpoint `--resume auto` would load from a directory."""

    path: Path
    step: int | None  # None when its manifest cannot be read
    for_stop: bool  # saved because the run was asked to stop (the trainer marks that save in its manifest)
    identity: tuple[int, int]  # its manifest's (inode, mtime): a save of the same step since then differs
    problem: str | None  # why --resume auto would refuse it; None when it is complete

    def saved_since(self, before: OnDisk | None) -> bool:
        """Whether this checkpoint was saved after `before` was read (by the run in between)."""
        return before is None or (self.path, self.identity) != (before.path, before.identity)


def latest_on_disk(ckpt_dir: Path) -> OnDisk | None:
    """The latest complete checkpoint in `ckpt_dir` as `--resume auto` finds it (the `latest` pointer, else
    the newest folder with a manifest); None when there is none.

    The manifest is parsed and every file it lists is checked for presence and size, but not hashed: this
    runs as `zoff train` exits (within seconds of a second signal), and a large checkpoint takes minutes to
    hash; `--resume` verifies every checksum before any rank starts.
    """
    path = find_checkpoint("auto", ckpt_dir)
    if path is None:
        return None
    try:
        st = os.stat(path / "manifest.json")
    except OSError as e:
        if not path.exists():  # pruned by a newer save between the lookup and now: that one is the latest
            return latest_on_disk(ckpt_dir)
        return OnDisk(path, None, False, (0, 0), f"{path / 'manifest.json'}: {e.strerror}")
    identity = (st.st_ino, st.st_mtime_ns)
    try:
        manifest = read_manifest(path, verify=False)
    except UserError as e:
        return OnDisk(path, None, False, identity, str(e))
    stop = bool(manifest["trainer"].get("stop"))
    return OnDisk(path, manifest["step"], stop, identity, _size_problem(path, manifest))


def _size_problem(path: Path, manifest: dict) -> str | None:
    """The first file the manifest lists that is missing or not of the size it lists; None if none is."""
    for name, meta in manifest["files"].items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{path / name}: missing"
        if size != meta["bytes"]:
            return f"{path / name}: {size} bytes, manifest says {meta['bytes']}"
    return None
