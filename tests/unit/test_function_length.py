"""Functions in zoff/ are 80 lines or fewer (def line to last line, docstring and comments included): a longer
one does several things, and each deserves a name."""

from __future__ import annotations

import ast
from pathlib import Path

ZOFF = Path(__file__).resolve().parents[2] / "zoff"
MAX_LINES = 80


def _long_functions(source: str, where: str) -> list[str]:
    """'where:line name (n lines)' for every function or method in `source` over MAX_LINES, nested ones too."""
    return [
        f"{where}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]


def test_functions_are_80_lines_or_fewer() -> None:
    paths = sorted(ZOFF.rglob("*.py"))
    assert len(paths) > 50  # the walk really sees the package
    long = [f for p in paths for f in _long_functions(p.read_text(), str(p.relative_to(ZOFF.parent)))]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_the_check_counts_from_def_to_last_line() -> None:
    """A method of 81 lines (def, docstring, 79 statements) is caught; a function of 80 lines is not."""
    statements = [f"    x{i} = {i}" for i in range(79)]
    long = ["class A:", "  def f(self):", '    """doc"""', *statements]
    short = ["def g():", *statements]
    assert _long_functions("\n".join(long + short), "a.py") == ["a.py:2 f (81 lines)"]
