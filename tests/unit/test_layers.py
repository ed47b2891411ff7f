"""zoff's packages form layers, and imports only point down: a lower layer never imports a higher one, and two
packages of one layer never import each other. The order is written once, here. Within a package, modules
import each other without a circle either (tests below, on the same walk of every import)."""

from __future__ import annotations

import ast
from pathlib import Path

ZOFF = Path(__file__).resolve().parents[2] / "zoff"

# Lowest first. The CLI only parses and calls; planning (the estimate) never imports the trainer.
LAYERS = [
    ["zoff.errors"],
    ["zoff.units", "zoff.host", "zoff.files"],
    ["zoff.config"],
    ["zoff.models", "zoff.data", "zoff.optim"],
    ["zoff.engine"],
    ["zoff.checkpoint", "zoff.planning"],
    ["zoff.trainer"],
    ["zoff.launch"],
    ["zoff.cli"],
    ["zoff.__main__"],
]


def _package(module: str) -> str:
    """The LAYERS entry a module belongs to (zoff.engine.reduce -> zoff.engine)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _layer(module: str) -> int:
    package = _package(module)
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise AssertionError(f"{module}: its package {package} is in no layer of tests/unit/test_layers.py")


def _submodule_or(base: str, name: str) -> str:
    """`from base import name`: the module base.name where there is one, else base (name is defined there)."""
    path = ZOFF.parent.joinpath(*base.split("."), name)
    return f"{base}.{name}" if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() else base


def _imports() -> list[tuple[str, str, int]]:
    """(importing module, imported zoff module, line) for every zoff import in zoff/: module level, lazy (in a
    function) and type-checking ones alike; relative imports resolved; `from a import b` names the module a.b
    where b is one."""
    out = []
    for path in sorted(ZOFF.rglob("*.py")):
        rel = path.relative_to(ZOFF.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                # relative: `from .x import y` in zoff/a/b.py (or in zoff/a/__init__.py) starts from zoff.a
                package = ".".join(rel.parts[: len(rel.parts) - node.level]) if node.level else ""
                base = ".".join(p for p in (package, node.module) if p)
                names = sorted({_submodule_or(base, a.name) for a in node.names})
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            out += [(module, n, node.lineno) for n in names if n.startswith("zoff.")]
    return out


def test_every_zoff_module_is_in_a_layer() -> None:
    for path in ZOFF.rglob("*.py"):
        rel = path.relative_to(ZOFF.parent).with_suffix("")
        if rel.parts != ("zoff", "__init__"):
            _layer(".".join(rel.parts))


def _violations(edges: list[tuple[str, str, int]]) -> list[str]:
    return [
        f"{a} (line {line}) imports {b}"
        for a, b, line in edges
        if _layer(b) > _layer(a) or (_layer(b) == _layer(a) and _package(b) != _package(a))
    ]


def test_imports_only_point_down() -> None:
    edges = _imports()
    assert len(edges) > 50  # the walk really sees the package
    bad = _violations(edges)
    assert not bad, "imports pointing up or sideways:\n" + "\n".join(bad)


def test_the_check_catches_upward_and_sideways_imports() -> None:
    """The estimator importing the trainer (as it once did for its loss) and planning importing checkpoint."""
    edges = [
        ("zoff.planning.activations", "zoff.trainer.session", 1),
        ("zoff.planning.memory", "zoff.checkpoint", 2),
        ("zoff.trainer.loop", "zoff.engine.zero", 3),
    ]
    assert _violations(edges) == [
        "zoff.planning.activations (line 1) imports zoff.trainer.session",
        "zoff.planning.memory (line 2) imports zoff.checkpoint",
    ]


def _circles(edges: list[tuple[str, str, int]]) -> list[list[str]]:
    """Import circles, each as the shortest way from a module back to itself, starting from each module (in
    sorted order) not already on one found. Edges are the imports written in the code. Python also runs a
    package's __init__ before any of its modules, but that implied edge (module -> its package) is not
    counted: a module reads nothing from its package unless it imports it, and that import is an edge here.
    So a package's __init__ importing its own modules is no circle, unless one of them imports it back."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
    circles: list[list[str]] = []
    for start in sorted(graph):
        if any(start in circle for circle in circles):
            continue
        came_from: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in came_from:  # breadth first: the first way back is a shortest one
            reached = []
            for here in frontier:
                for nxt in sorted(graph.get(here, ())):
                    if nxt not in came_from:
                        came_from[nxt] = here
                        reached.append(nxt)
            frontier = reached
        if start in came_from:
            path, node = [start], came_from[start]
            while node != start:
                path.append(node)
                node = came_from[node]
            circles.append([start, *path[:0:-1], start])
    return circles


def test_no_import_circles() -> None:
    circles = _circles(_imports())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_check_catches_a_circle() -> None:
    """The circle convert and peft_export once made (peft_export took tied_names back from convert), beside a
    package's __init__ importing its own module and a chain that only runs down."""
    edges = [
        ("zoff.checkpoint.convert", "zoff.checkpoint.peft_export", 248),
        ("zoff.checkpoint.peft_export", "zoff.models.lora", 27),
        ("zoff.checkpoint.peft_export", "zoff.checkpoint.convert", 94),
        ("zoff.models", "zoff.models.gpt", 15),
        ("zoff.models.gpt", "zoff.config", 10),
    ]
    assert _circles(edges) == [
        ["zoff.checkpoint.convert", "zoff.checkpoint.peft_export", "zoff.checkpoint.convert"]
    ]
    assert _circles(edges[:2] + edges[3:]) == []
