"""The config reference, read from the schema itself: every key's type, default, allowed range and meaning
(the comments beside and above its field in sections.py, and each section's docstring). docs/configuration.md
embeds `markdown()` (a test fails when the page and the schema differ) and `zoff validate --explain KEY`
prints `explain(KEY)`, so the page, the command and the code cannot drift apart."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import tokenize
import typing
from dataclasses import dataclass
from functools import cache

from zoff.config import sections
from zoff.config.schema import suggest
from zoff.errors import ConfigError


@dataclass(frozen=True)
class Key:
    path: str  # dotted, as overrides spell it: zero.offload_optimizer.io.threads
    type: str
    default: str
    range: str  # "" when the type bounds it alone
    meaning: str


def _type_name(tp: typing.Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict or tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _number(v: float) -> str:
    """2^k for the powers of two that bound sizes, else the plain number."""
    if isinstance(v, int) and v >= 1 << 16 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"
    return f"{v:g}"


def _range(meta: typing.Mapping) -> str:
    lo, hi, gt = meta.get("lo"), meta.get("hi"), meta.get("gt", False)
    if lo is None and hi is None:
        return ""
    left = "" if lo is None else f"{_number(lo)} {'<' if gt else '<='} "
    right = "" if hi is None else f" <= {_number(hi)}"
    return f"{left}x{right}"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return ""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) and v >= 1 << 20 and v % (1 << 20) == 0:
        return f"{v} ({v >> 20} MiB)" if v < 1 << 30 else f"{v} ({v >> 30} GiB)"
    return str(v) if not isinstance(v, str) else (v or '""')


@cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comments above it (a block with no blank line between) and inside its statement."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []
    name, start, inline = None, 0, []
    for tok in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        text = tok.string.lstrip("#").strip() if tok.type == tokenize.COMMENT else ""
        if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#"):
            above.append(text)  # a comment line of its own: about the field below
        elif tok.type == tokenize.COMMENT:
            inline.append(text)  # beside the field, on any line of its statement
        elif tok.type == tokenize.NL and not tok.line.strip():
            above = []  # a blank line ends a comment block
        elif tok.type == tokenize.NAME and name is None and tok.start[1] == 4:
            name, start, inline = tok.string, tok.start[0], []
            mine, above = above, []
        elif tok.type == tokenize.NEWLINE:
            if name in names and start:
                out[name] = " ".join([*mine, *inline]).replace("|", "\\|")
            name, inline = None, []
    return out


def _doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    generated = doc.startswith(cls.__name__ + "(")  # dataclass writes its signature where no docstring is
    return "" if generated else " ".join(doc.split())


def keys(cls: type = sections.Config, prefix: str = "") -> list[Key]:
    """Every leaf key below `cls`, in the order the schema declares them."""
    hints = typing.get_type_hints(cls)
    notes: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # a section inherits its base's keys, and their comments
        if dataclasses.is_dataclass(base):
            notes.update(_comments(base))
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out.extend(keys(tp, path + "."))
            continue
        out.append(Key(path, _type_name(tp), _default(f), _range(f.metadata), notes.get(f.name, "")))
    return out


def section_docs(cls: type = sections.Config, prefix: str = "") -> dict[str, str]:
    """Dotted section path -> its docstring (sections without one are left out)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            path = f"{prefix}{f.name}"
            if _doc(tp):
                out[path] = _doc(tp)
            out.update(section_docs(tp, path + "."))
    return out


def markdown() -> str:
    """The reference, one table per top-level section (what docs/configuration.md embeds)."""
    docs = section_docs()
    parts: list[str] = []
    for top in (f.name for f in dataclasses.fields(sections.Config)):
        rows = [k for k in keys() if k.path.split(".")[0] == top]
        parts.append(f"### `{top}`\n\n")
        for path, doc in docs.items():
            if path == top or path.startswith(top + "."):
                parts.append(f"`{path}`: {doc}\n\n")
        parts.append("| key | type | default | range | meaning |\n|---|---|---|---|---|\n")
        for k in rows:
            parts.append(f"| `{k.path}` | {k.type} | `{k.default}` | {k.range} | {k.meaning} |\n")
        parts.append("\n")
    return "".join(parts)


def explain(path: str) -> str:
    """One key's entry (or, for a section, each of its keys'), as the reference has it."""
    found = [k for k in keys() if k.path == path or k.path.startswith(path + ".")]
    if not found:
        last = path.rsplit(".", 1)[-1]  # a key misplaced or misspelt is most often known by its own name
        near = [
            k.path
            for k in keys()
            if difflib.get_close_matches(last, [k.path.rsplit(".", 1)[-1]], cutoff=0.75)
        ]
        hint = f" (did you mean '{near[0]}'?)" if near else suggest(path, [k.path for k in keys()])
        raise ConfigError(f"unknown key {path}{hint}")
    lines = []
    doc = section_docs().get(path)
    if doc:
        lines.append(f"{path}: {doc}")
    for k in found:
        rng = f", {k.range}" if k.range else ""
        meaning = k.meaning.replace("\\|", "|")
        tp = k.type.replace("\\|", "|")
        lines.append(f"{k.path}: {tp} (default {k.default}{rng})" + (f": {meaning}" if meaning else ""))
    return "\n".join(lines) + "\n"
