"""Stage 3 with blocks that some rank skips (an expert no token picked, a layer its data dropped): the run goes
on by gathering the module that holds them as one unit.

A rank whose gather check finds that the ranks ran different blocks (engine/comm/gather_checks.py: named within
one message's latency, never a hang) writes the class that fixes it into <run_dir>/regather.json and fails;
`zoff train` then restarts the ranks from the latest complete checkpoint (or from step 0) with that class
added to zero.block_classes, and says so. A restarted rank (torch elastic's own restarts too) reads the file
and adds the classes itself. What it costs: the restart, and gather units as large as the holding module
(the whole model when the blocks hang off the model itself: stage 2's parameter memory).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from zoff.config import Config

FILE = "regather.json"


def note(run_dir: Path, block_class: str, message: str) -> None:
    """A rank found skipped blocks: record the class that fixes it (every rank that finds it writes the same)."""
    path = run_dir / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"block_classes": [block_class], "message": message}) + "\n")
    tmp.replace(path)


def recorded(run_dir: Path) -> tuple[list[str], str]:
    """(classes the ranks asked for, the first rank's message); ([], "") when none did."""
    try:
        data = json.loads((run_dir / FILE).read_text())
    except (OSError, ValueError):
        return [], ""
    return [str(c) for c in data.get("block_classes", [])], str(data.get("message", ""))


def with_classes(cfg: Config, classes: list[str]) -> Config:
    """cfg with `classes` added to zero.block_classes (in order, once each)."""
    merged = list(dict.fromkeys([*cfg.zero.block_classes, *classes]))
    if merged == list(cfg.zero.block_classes):
        return cfg
    return dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, block_classes=merged))


def restart_config(cfg: Config, run_dir: Path) -> Config | None:
    """After a failed launch: the config to restart with, or None when the failure was not skipped blocks
    (or the classes are already gathered whole, so another restart would fail the same way)."""
    classes, _ = recorded(run_dir)
    again = with_classes(cfg, classes)
    return None if again is cfg else again
