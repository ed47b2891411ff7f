"""The front door: README.md stays short, every link in README.md, CHANGELOG.md and docs/ resolves (files and
headings), and every result table is rendered from its JSON under docs/results/ (scripts/render_docs.py):
a page that differs from its JSON fails, and so does a JSON whose numbers change under a page."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")

_spec = importlib.util.spec_from_file_location("render_docs", REPO / "scripts" / "render_docs.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but - and _, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 260


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not walked (no network here)
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            bad.append(f"{target}: no file {where}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            bad.append(f"{target}: no heading #{anchor} in {where.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def _regions() -> list[tuple[Path, str, str]]:
    return [(p, name, body) for p in PAGES for name, body in R.regions(p.read_text())]


def test_the_readme_has_its_results_table() -> None:
    assert "headline" in {name for page, name, _ in _regions() if page.name == "README.md"}


@pytest.mark.parametrize("region", _regions(), ids=lambda r: f"{r[0].name}:{r[1]}")
def test_the_page_shows_the_table_rendered_from_its_json(region) -> None:
    page, name, body = region
    assert body == R.rendered(name), (
        f"{page.name}: {name} differs from its JSON (python scripts/render_docs.py)"
    )


def test_every_preset_of_a_script_has_its_region_rendered_from_its_json() -> None:
    """A script with PRESETS (bench_beyond_memory --preset 2g, ...): each preset's JSON shows in a region
    named after it (`render: SCRIPT --preset V`; the default's is `render: SCRIPT`), rendered by the script's
    render() from that JSON."""
    names = {name for _, name, _ in _regions()}
    scripts = {name.partition(" --preset ")[0] for name in names}
    with_presets = {s: R.script(s) for s in sorted(scripts) if hasattr(R.script(s), "PRESETS")}
    assert {"bench_beyond_memory", "bench_overlap"} <= set(with_presets)
    for base, module in with_presets.items():
        for preset, setup in module.PRESETS.items():
            name = base if preset == "default" else f"{base} --preset {preset}"
            assert name in names, f"no page has the region `render: {name}`"
            assert R.json_path(name) == setup.json
            assert R.rendered(name) == module.render(json.loads(setup.json.read_text())).rstrip("\n") + "\n"


def _numbers(obj, path=()):
    """(path, value) of every number in a JSON document."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, (*path, i))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


@pytest.mark.parametrize("name", sorted({n for _, n, _ in _regions()} - {"headline", "config_reference"}))
def test_a_changed_number_in_the_json_changes_the_table(name: str) -> None:  # (the reference has no JSON)
    """Some number the table shows, changed in its JSON, changes the rendered table (the page then fails)."""
    data = json.loads(R.json_path(name).read_text())
    shown = R.rendered(name, data)
    for path, value in _numbers(data):
        changed = copy.deepcopy(data)
        node = changed
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value * 1.5 + 7
        try:
            if R.rendered(name, changed) != shown:
                return
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            continue
    pytest.fail(f"{name}: no number of its JSON shows in its table")


@pytest.mark.parametrize(
    "args",
    [
        "configs/gpt-7b.yaml --gpus-per-node 1 --gpu-memory 24GiB --cpu-memory 128GiB --suggest",
        "configs/gpt-70b.yaml --gpus-per-node 8 --gpu-memory 80GiB --cpu-memory 2TiB --suggest",
    ],
)
def test_the_readme_worked_examples_are_what_zoff_estimate_answers(args: str) -> None:
    """ "7B on one 24 GiB GPU" and "70B on 8 GPUs": the README quotes the command and its answer."""
    from typer.testing import CliRunner

    from zoff.cli import app

    result = CliRunner().invoke(app, ["estimate", *args.split()], terminal_width=300)
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("suggested: "))
    m = re.match(
        r"suggested: (\S+) \+ activation checkpointing: .*? \(([\d.]+ GiB) per GPU, ([\d.]+ [GT]iB) CPU", line
    )
    assert m, line
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"zoff estimate {args}" in readme
    assert f"`{m[1]}` with activation checkpointing: {m[2]}" in readme, line
    assert m[3] in readme, line
