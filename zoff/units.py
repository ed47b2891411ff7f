"""Human sizes: parse '80GB' / '24GiB' / '1e9' into bytes and print bytes back with binary units."""

from __future__ import annotations

import re

from zoff.errors import UserError

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


def parse_size(text: str, flag: str, lo: int = 1, hi: int = 2**50) -> int:
    """'80GB' (decimal), '24GiB' (binary), '1.5T', '1e9' -> bytes; a UserError naming `flag` otherwise."""
    hint = "expected e.g. 80GB or 24GiB"
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kKmMgGtTpP]?)(i?)[bB]?\s*", text or "")
    if not m:
        raise UserError(f"{flag}: cannot parse '{text}' ({hint})")
    unit = _UNITS[m.group(2).lower()]
    if m.group(3):
        unit = 1024 ** list(_UNITS).index(m.group(2).lower())
    size = float(m.group(1)) * unit  # 1e400 is inf: caught by the range check, never int()-ed
    if not lo <= size <= hi:
        raise UserError(f"{flag}: {text} is out of range ({human(lo)} to {human(hi)}; {hint})")
    return int(size)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""  # unreachable
