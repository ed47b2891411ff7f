"""The config reference region of docs/configuration.md: rendered from the schema (zoff/config/reference.py),
not from a JSON; `python scripts/render_docs.py` rewrites it and the docs test fails when it differs."""

from __future__ import annotations

from zoff.config.reference import markdown


def load() -> dict:
    return {}


def render(data: dict) -> str:
    return markdown()
