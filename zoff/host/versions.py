"""The torch releases zoff is checked on, and where an installed torch stands against them (`zoff doctor`).

One place for the range: pyproject.toml requires TORCH_REQUIRED; scripts/torch_range.py runs the quickstart
and a test suite on a release in a fresh venv and writes docs/results/torch_range.json, whose table the docs
show; tests/unit/test_torch_range.py holds these constants equal to both (the package never reads the JSON).
After checking a new release: add it here and move TORCH_CHECKED_BELOW.
"""

from __future__ import annotations

import re

# pyproject.toml's lower bound: 2.11's elastic launcher is the first with signals_to_handle (launch.elastic.check_torch)
TORCH_REQUIRED = "2.11"
# Releases whose quickstart and whole default suite passed on the CPU (scripts/torch_range.py).
TORCH_CHECKED_CPU = ("2.12.0", "2.13.0", "2.14.1", "2.15.0")
# Checked only by scripts/gpu_check.sh on the GPU machines, which run this release (docs/gpus.md).
TORCH_CHECKED_GPU = ("2.11.0",)
# The first minor release nobody has checked. Not an upper bound in pyproject.toml: pip would then replace
# a newer (or a vendor's 2.16.0a0) torch with a multi-GB download; doctor says "not checked" instead.
TORCH_CHECKED_BELOW = "2.16"


def _minor(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.13.0+cpu" -> (2, 13), "2.16.0a0+git1" -> (2, 16)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m[1]), int(m[2])


def _release(version: str) -> str:
    """The release a build belongs to: "2.13.0+cpu" -> "2.13.0" (the local label names the build)."""
    return version.split("+", 1)[0]


def checked_range() -> str:
    """The range in words, as the docs state it."""
    return (
        f"torch>={TORCH_REQUIRED}; checked: {', '.join(TORCH_CHECKED_GPU)} (GPU check only), "
        f"{', '.join(TORCH_CHECKED_CPU)} (CPU: quickstart and quick suite)"
    )


def torch_status(version: str) -> str:
    """Where `version` stands: refused, checked (how), inside a checked series, or newer than any checked."""
    minor, release = _minor(version), _release(version)
    if minor < _minor(TORCH_REQUIRED):
        return f"{version}: older than zoff needs (torch>={TORCH_REQUIRED}); zoff train refuses it"
    if release in TORCH_CHECKED_CPU:
        return f"{version}: checked on the CPU (quickstart and quick suite)"
    if release in TORCH_CHECKED_GPU:
        return f"{version}: checked by the GPU check only"
    if minor >= _minor(TORCH_CHECKED_BELOW):
        return (
            f"{version}: newer than any checked (below {TORCH_CHECKED_BELOW}); "
            f"python scripts/torch_range.py {release} checks it"
        )
    series = [v for v in TORCH_CHECKED_CPU + TORCH_CHECKED_GPU if _minor(v) == minor]
    if series:
        return f"{version}: not itself checked; its series was, on {', '.join(series)}"
    return f"{version}: inside the range but not checked; python scripts/torch_range.py {release} checks it"
