"""JSON Lines read as untrusted input: every line bounded (data.max_line_bytes), decoded strictly as UTF-8,
parsed with its nesting bounded. A line that fails comes back as a Bad value naming why, for the caller to
count (fine-tuning records) or stop on (pretraining text), never silently repaired."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from zoff.units import human

CHUNK = 1 << 20  # bytes read at a time while skipping the rest of an overlong line


class Bad(str):
    """Why a line is not a record (the text of the message)."""


def jsonl(path: Path, max_line_bytes: int) -> Iterator[tuple[int, object]]:
    """(line number, parsed object or Bad) for each non-blank line of `path`.

    A line longer than `max_line_bytes` is never held whole (it is skipped in CHUNK reads); invalid UTF-8 is
    a Bad line, not text with replacement characters trained on; JSON nested too deep for the parser is Bad
    rather than a RecursionError (json's C parser recurses once per level)."""
    with open(path, "rb") as f:
        lineno = 0
        while True:
            line = f.readline(max_line_bytes + 1)
            if not line:
                return
            lineno += 1
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # the rest of it, a chunk at a time
                    line = f.readline(CHUNK)
                yield lineno, Bad(f"line longer than data.max_line_bytes ({human(max_line_bytes)})")
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, Bad(f"invalid UTF-8 at byte {e.start}")
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield lineno, Bad(f"not valid JSON ({e.msg})")
                continue
            except RecursionError:
                yield lineno, Bad("JSON nested too deep")
                continue
            # json turns an escaped lone surrogate ("\ud800") into a str no codec can encode: found only where
            # the line has such an escape, so clean lines cost one substring search
            if b"\\ud" in line.lower() and _has_lone_surrogate(obj):
                yield (
                    lineno,
                    Bad("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"),
                )
                continue
            yield lineno, obj


def _has_lone_surrogate(obj: object) -> bool:
    stack = [obj]  # iterative: the parse above already bounded the depth, this bounds the stack too
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False
