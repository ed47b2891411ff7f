"""The table of a scripts/gpu_check.sh run: from its steps.tsv to summary.json and summary.md, and docs/gpus.md.

    python scripts/gpu_check_report.py DIR [HEADER]   # DIR/steps.tsv -> DIR/summary.{json,md}; exit 1 if a step failed

gpu_check.sh calls it at its end. A run worth keeping is copied to docs/results/gpu_check.json, which
render_docs.py renders into docs/gpus.md (`<!-- render: gpu_check_report -->`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

JSON = Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu_check.json"
KEYS = ("step", "exit", "seconds", "result", "command")


def steps_from_tsv(path: Path) -> list[dict]:
    """One dict a step: name, exit code, seconds, one-line result, command (gpu_check.sh's tab-separated rows)."""
    steps = [dict(zip(KEYS, ln.split("\t"))) for ln in path.read_text().splitlines()]
    for s in steps:
        s["exit"], s["seconds"] = int(s["exit"]), int(s["seconds"])
    return steps


def render(data: dict) -> str:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    md = [f"zoff gpu_check: {data['header']}", "", "| step | exit | s | result |", "|---|---:|---:|---|"]
    md += [
        f"| {cell(s['step'])} | {s['exit']} | {s['seconds']} | {cell(s['result'])} |" for s in data["steps"]
    ]
    return "\n".join(md) + "\n"


def main(argv: list[str]) -> int:
    out, header = Path(argv[0]), argv[1] if len(argv) > 1 else ""
    steps = steps_from_tsv(out / "steps.tsv")
    ok = all(s["exit"] == 0 for s in steps)
    data = {"header": header, "passed": ok, "steps": steps}
    md = render(data) + "\n" + ("all steps passed" if ok else f"FAILED: see the logs in {out}") + "\n"
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_text(json.dumps(data, indent=2) + "\n")
    print(md, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
