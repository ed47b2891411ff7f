"""zoff's packages form layers, and imports only point down: a lower layer never imports a higher one, and two
packages of one layer never import each other. The order is written once, here."""

from __future__ import annotations

import ast
from pathlib import Path

ZOFF = Path(__file__).resolve().parents[2] / "zoff"

# Lowest first. The CLI only parses and calls; planning (the estimate) never imports the trainer.
LAYERS = [
    ["zoff.errors"],
    ["zoff.units"],
    ["zoff.host", "zoff.files"],
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


def _imports() -> list[tuple[str, str, int]]:
    """(importing module, imported zoff module, line) for every zoff import in zoff/, lazy ones included."""
    out = []
    for path in sorted(ZOFF.rglob("*.py")):
        rel = path.relative_to(ZOFF.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
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
