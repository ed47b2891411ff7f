"""torch_range.py's reading half: what pip, pytest and the quickstart printed or wrote, read into a version's
JSON fields; the JSON merged with new entries, which releases passed, and the table the docs embed. Nothing
here runs anything, so the tests and render_docs.py use it without installing a torch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

WARNING = re.compile(r"(?P<path>/\S+?\.py):(?P<line>\d+): (?P<cat>\w*Warning): (?P<msg>.*)")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")

# The README's quickstart: "ends near loss 2.3 (val 2.4, from 5.35) after 300 steps".
README_QUICKSTART = {"final_loss": 2.3, "final_val_loss": 2.4}
QUICKSTART_TOLERANCE = 0.25  # another torch's kernels may move the last step's loss a little (none has yet)


# ------------------------------------------------------------------------------- reading what ran
def pytest_counts(output: str) -> dict:
    """passed/failed/skipped/errors from pytest's closing line (the last line that counts anything)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for line in reversed(output.splitlines()):
        found = COUNT.findall(line)
        if found and re.search(r" in [\d.]+s", line):
            for n, what in found:
                key = "errors" if what.startswith("error") else what
                if key in counts:
                    counts[key] = int(n)
            break
    return counts


def first_failures(output: str, limit: int = 25) -> list[str]:
    """Node ids from pytest's -rfE short summary ("FAILED node - why", "ERROR node - why")."""
    ids = [m[2] for m in re.finditer(r"^(FAILED|ERROR) (\S+)", output, re.M)]
    return list(dict.fromkeys(ids))[:limit]


def zoff_warnings(text: str, src: Path) -> tuple[list[dict], list[dict]]:
    """Unique Deprecation/FutureWarnings in `text`: (those located in src/zoff/, those located elsewhere).
    A torch deprecation names its caller's line (stacklevel), so a zoff call to a deprecated API lands in
    the first list; the second keeps what torch or a library warns about inside itself, for the reader."""
    mine: dict[tuple, dict] = {}
    other: dict[tuple, dict] = {}
    root = str(src / "zoff") + os.sep
    for m in WARNING.finditer(text):
        if m["cat"] not in ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning"):
            continue
        path = m["path"]
        if path.startswith(root):
            where = f"zoff/{path[len(root) :]}:{m['line']}"
            mine.setdefault((where, m["msg"]), {"where": where, "category": m["cat"], "message": m["msg"]})
        else:
            short = path.split("site-packages/", 1)[-1]
            where = f"{short}:{m['line']}"
            other.setdefault((where, m["msg"]), {"where": where, "category": m["cat"], "message": m["msg"]})
    return list(mine.values()), list(other.values())[:10]


def quickstart_result(code: int | None, out: str, secs: float, summary: Path) -> dict:
    """The quickstart's entry: its final losses (summary.json) against the README's, else why it failed."""
    qs: dict = {"ok": code == 0 and summary.is_file(), "seconds": round(secs, 1)}
    if qs["ok"]:
        s = json.loads(summary.read_text())
        qs.update(
            final_loss=round(s["final_loss"], 4),
            final_val_loss=round(s["final_val_loss"], 4),
            first_loss=round(s["first_loss"], 4),
            near_readme=all(abs(s[k] - v) <= QUICKSTART_TOLERANCE for k, v in README_QUICKSTART.items()),
        )
    else:
        qs["error"] = "timed out" if code is None else tail(out, 2)
    return qs


def suite_result(code: int | None, out: str, secs: float, args: list[str]) -> dict:
    """The tests' entry: what `pytest args` printed, counted, and the first tests it failed."""
    return {
        "command": "python -m pytest -q" + "".join(f" {a}" for a in args),
        **pytest_counts(out),
        "seconds": round(secs, 1),
        "exit_code": code,
        "timed_out": code is None,
        "first_failures": first_failures(out),
    }


def pip_error(out: str) -> str:
    """What pip said went wrong: its conflict's lines (who asked for what), else its last ERROR line."""
    lines = [ln.strip() for ln in out.splitlines()]
    why = [ln for ln in lines if " depends on " in ln or ln.startswith("The user requested")]
    errors = [ln for ln in lines if ln.startswith("ERROR:") and "ResolutionImpossible" not in ln]
    return " / ".join(why[:3] or errors[-1:] or [tail(out, 2)])[:400]


def tail(text: str, n: int = 1) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(lines[-n:])[:300]


# ------------------------------------------------------------------------------- the JSON and its table
def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def merge(old: dict, entries: dict[str, dict]) -> dict:
    """The JSON with `entries` replacing those versions' entries; every other version kept."""
    versions = {**old.get("versions", {}), **entries}
    return {"versions": {v: versions[v] for v in sorted(versions, key=version_key)}}


def _cell(v: object) -> str:
    return str(v).replace("|", "\\|")


def _failures(e: dict) -> set[str] | None:
    """A version's failing and erroring tests; None where the suite did not finish or some went unnamed."""
    t = e.get("tests", {})
    if not t or t.get("timed_out") or t["failed"] + t["errors"] > len(t["first_failures"]):
        return None
    return set(t["first_failures"])


def common_failures(data: dict) -> set[str]:
    """Tests failing on every version that ran (at least two): the tree's failures, not a torch's."""
    sets = [_failures(e) for e in data.get("versions", {}).values() if e.get("tests")]
    return set.intersection(*sets) if len(sets) >= 2 and None not in sets else set()


def passed(data: dict) -> list[str]:
    """The releases checked: installed, the quickstart near the README's loss, and no failing test that the
    other versions pass (zoff/host/versions.py's TORCH_CHECKED_CPU holds these)."""
    common, out = common_failures(data), []
    for e in data.get("versions", {}).values():
        fails = _failures(e)
        if e["install"]["ok"] and e.get("quickstart", {}).get("near_readme") and fails is not None:
            if fails <= common:
                out.append(e["torch_version"].split("+")[0])
    return out


def render(data: dict) -> str:
    """A markdown table, one row per checked torch version, then its failures and zoff's warnings."""
    header = [
        "torch",
        "build",
        "Python",
        "install",
        "quickstart loss (val), s",
        "suite",
        "passed",
        "failed",
        "skipped",
        "errors",
        "tests, s",
        "zoff warnings",
        "result",
        "commit, date",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 6 + "---:|" * 6 + "---|---|"]
    notes = []
    good, common = passed(data), common_failures(data)
    for v, e in data.get("versions", {}).items():
        inst, qs, t = e.get("install", {}), e.get("quickstart", {}), e.get("tests", {})
        if qs.get("final_loss") is not None:
            near = "" if qs.get("near_readme") else ", not near the README's 2.3"
            loss = f"{qs['final_loss']:.2f} ({qs['final_val_loss']:.2f}), {qs['seconds']:.0f}{near}"
        else:
            loss = "failed" if qs else "not run"
        ran = bool(t)
        row = [
            e.get("torch_version", v),
            e.get("build", "?"),
            e.get("python", "?"),
            "ok" if inst.get("ok") else "failed",
            loss,
            e.get("suite", "?") + (" (timed out)" if t.get("timed_out") else ""),
            *(str(t.get(k, 0)) if ran else "-" for k in ("passed", "failed", "skipped", "errors")),
            f"{t['seconds']:.0f}" if ran else "-",
            str(len(e.get("warnings", []))),
            "pass" if e.get("torch_version", v).split("+")[0] in good else "FAIL",
            f"{e.get('commit', '?')}, {e.get('date', '?')[:10]}",
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        own = [n for n in t.get("first_failures", []) if n not in common]
        if own:
            notes.append(f"- {v} failures: " + ", ".join(f"`{n}`" for n in own))
        if not inst.get("ok") and inst.get("error"):
            notes.append(f"- {v} install: {_cell(inst['error'])}")
        for w in e.get("warnings", []):
            notes.append(f"- {v} warning: `{w['where']}` {w['category']}: {_cell(w['message'])}")
    if common:
        notes.insert(
            0,
            "- failing on every version (the commit's, not torch's; not held against a release): "
            + ", ".join(f"`{n}`" for n in sorted(common)),
        )
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
