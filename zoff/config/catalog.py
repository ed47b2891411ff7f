"""`zoff ls` and `zoff cp`: the shipped configs and recipes, described by their header comments.

Every shipped YAML starts with a comment whose first line is `# NAME: what it is`; that line is the
description `zoff ls` prints. `zoff cp NAME DEST` copies one out for editing and never overwrites.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from zoff.config import CONFIGS_DIR, RECIPES_DIR
from zoff.config.schema import suggest
from zoff.errors import UserError

KINDS = {"configs": CONFIGS_DIR, "recipes": RECIPES_DIR}


@dataclass(frozen=True)
class Entry:
    kind: str  # configs or recipes
    name: str
    path: Path
    description: str


def entries() -> list[Entry]:
    out = []
    for kind, folder in KINDS.items():
        for path in sorted(folder.glob("*.yaml")):
            out.append(Entry(kind, path.stem, path, describe(path)))
    return out


def describe(path: Path) -> str:
    """The first header comment line, without its `# name:` label."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text:
            continue
        label, sep, rest = text.partition(": ")
        return rest.strip() if sep and path.stem in label else text
    return ""


def listing() -> str:
    items = entries()
    width = max((len(e.name) for e in items), default=0)
    lines = []
    for kind in KINDS:
        lines.append(f"{kind} ({KINDS[kind]}):")
        lines += [f"  {e.name:<{width}}  {e.description}" for e in items if e.kind == kind]
    lines.append("Copy one out with: zoff cp NAME DEST")
    return "\n".join(lines)


def find(name: str) -> Entry:
    """NAME, NAME.yaml, configs/NAME or recipes/NAME."""
    kind, _, stem = name.rpartition("/")
    stem = stem.removesuffix(".yaml")
    hits = [e for e in entries() if e.name == stem and (not kind or e.kind == kind)]
    if not hits:
        raise UserError(
            f"NAME: no shipped config or recipe '{name}'{suggest(stem, [e.name for e in entries()])}"
        )
    if len(hits) > 1:
        raise UserError(
            f"NAME: '{name}' is both {' and '.join(f'{e.kind}/{e.name}' for e in hits)}; say which"
        )
    return hits[0]


def usage(name: str, target: Path) -> str:
    """The command that uses a copy made by `copy(name, ...)`: a config is trained; a recipe is a config's
    zero policy (a path ending in .yaml: zoff.config's _recipe_file)."""
    where = shlex.quote(str(target))
    if find(name).kind == "recipes":
        return f"zoff train CONFIG zero={where}   (or, in a config: `zero: {{recipe: {target}}}`)"
    return f"zoff train {where}"


def copy(name: str, dest: Path) -> Path:
    """Copy the named YAML to dest (a file, or an existing folder to copy into); never overwrites."""
    entry = find(name)
    target = dest / entry.path.name if dest.is_dir() else dest
    if not target.parent.is_dir():
        raise UserError(f"DEST: its folder {target.parent} does not exist")
    try:
        with open(target, "x") as f:  # "x": fails if the file exists, so two copies never race
            f.write(entry.path.read_text())
    except FileExistsError:
        raise UserError(f"{target}: already exists (zoff cp never overwrites; choose another DEST)") from None
    except OSError as e:
        raise UserError(f"DEST: cannot write {target}: {e.strerror}") from None
    return target
