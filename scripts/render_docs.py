"""Render the result tables in README.md and docs/*.md from the JSON the benchmark scripts wrote.

    python scripts/render_docs.py            # rewrite every marked region from docs/results/*.json
    python scripts/render_docs.py --check    # exit 1 naming each region that differs (what the tests run)

A page marks a table with two comments; what lies between them is generated, never typed:

    <!-- render: bench_adam -->
    ...
    <!-- /render -->

`render: NAME` is `scripts/NAME.py`'s `render(json.load(NAME.JSON))` (each script writes its JSON under
docs/results/ and renders its own table); `render: NAME --preset V` renders the JSON of the script's preset V
(`NAME.PRESETS[V].json`, what `python scripts/NAME.py --preset V` writes) with the same render(); `render:
headline` is the README's one-row-per-benchmark table (headline.py beside this script), built from the same JSON
files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# a region's name: the script, and the preset whose JSON it shows ("bench_beyond_memory --preset 2g")
REGION = re.compile(
    r"(<!-- render: (?P<name>[\w-]+(?: --preset [\w-]+)?) -->\n)(?P<body>.*?)(<!-- /render -->)", re.S
)


def script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (the scripts are not a package)."""
    if str(REPO / "scripts") not in sys.path:  # the scripts import their shared benchlib.py as a sibling
        sys.path.insert(0, str(REPO / "scripts"))
    path = REPO / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_render_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the script look their module up here
    spec.loader.exec_module(module)
    return module


def json_path(name: str) -> Path | None:
    """The JSON region `name` renders ("SCRIPT" or "SCRIPT --preset V"); None for a script without one."""
    base, _, preset = name.partition(" --preset ")
    module = script(base)
    if preset:
        return Path(module.PRESETS[preset].json)
    return Path(module.JSON) if hasattr(module, "JSON") else None


def rendered(name: str, data: dict | None = None) -> str:
    """The markdown of region `name`: from `data`, or from the JSON on disk (a script without one: its load())."""
    module = script(name.partition(" --preset ")[0])
    if data is None:
        path = json_path(name)
        data = json.loads(path.read_text()) if path else module.load()
    return module.render(data).rstrip("\n") + "\n"


def regions(text: str) -> list[tuple[str, str]]:
    """(name, current body) of each marked region of a page."""
    return [(m["name"], m["body"]) for m in REGION.finditer(text)]


def fill(text: str, render=rendered) -> str:
    """The page with every region's body replaced by what `render(name)` gives."""
    return REGION.sub(lambda m: m.group(1) + render(m["name"]) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="name the regions that differ; change nothing")
    args = ap.parse_args(argv)
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = fill(text)
        if new != text:
            stale += [
                f"{page.relative_to(REPO)}: {name}" for name, body in regions(text) if body != rendered(name)
            ]
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("stale tables (python scripts/render_docs.py rewrites them):\n  " + "\n  ".join(stale))
        return 1
    print("rewrote: " + ", ".join(stale) if stale else "every table matches its JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
