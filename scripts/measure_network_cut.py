#!/usr/bin/env python
"""Measure how long a job takes to notice and survive a node lost to its network. Not a test; root only.

Two `zoff train configs/tiny.yaml` agents in network namespaces on one bridge (tests/netns.py), --nnodes 1:2
with one rank each; node 1's link is cut (`ip link set eth0 down`) at step 30. Timed from the cut (the
helpers of tests/netcut.py, polling every 0.1 s): the survivor's `zoff: lost node ...` line, its first step
after re-forming alone from the last checkpoint, and the cut-off node's exit. Each setting runs `--repeats`
times; the JSON keeps every run and the host.

    sudo python scripts/measure_network_cut.py [--repeats 2] [--out docs/results/network_cut.json]
    python scripts/measure_network_cut.py --render   # the markdown table docs/cluster.md embeds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import netcut, netns  # noqa: E402
from tests.processes import Agent  # noqa: E402

OUT = REPO / "docs" / "results" / "network_cut.json"
# (name, overrides): torch's and zoff's defaults (5 s heartbeats, 30 s last call), and shorter ones
SETTINGS = [
    ("defaults", ()),
    ("keep_alive 1 s, last call 5 s", ("launch.rdzv_keep_alive_s=1", "launch.rdzv_last_call_s=5")),
]


def one_run(overrides: tuple[str, ...]) -> dict:
    nodes, started = netns.Nodes(2), []

    def start(*args, **kw) -> Agent:
        started.append(Agent(*args, **kw))
        return started[-1]

    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            agents = netcut.start_nodes(start, nodes, run_dir, netcut.config(300, *overrides))
            times = netcut.cut_and_time(agents, nodes, run_dir, 30, timeout=300)
            times["cut_node_code"] = agents[-1].proc.poll()
            times["survivor_code"] = agents[0].wait(timeout=300)
            return times
    finally:
        for a in started:
            a.cleanup()
        nodes.close()


def measure(repeats: int, out: Path) -> None:
    why = netns.unavailable()
    if why:
        raise SystemExit(f"measure_network_cut: {why}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "commit": commit.stdout.strip()},
        "cut_at_step": 30,
        "settings": [],
    }
    for name, overrides in SETTINGS:
        runs = [one_run(overrides) for _ in range(repeats)]
        print(name, runs, flush=True)
        result["settings"].append({"name": name, "overrides": list(overrides), "runs": runs})
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


def render(result: dict) -> str:
    """One row per setting: each time as the runs' range."""

    def span(runs: list[dict], key: str) -> str:
        vals = [r[key] for r in runs]
        if None in vals:
            return "not within 300 s"
        lo, hi = min(vals), max(vals)
        return f"{lo:.0f} s" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f} s"

    rows = [
        "| settings | survivor names the lost node | survivor's first step after re-forming | cut-off node exits |",
        "|---|---|---|---|",
    ]
    for s in result["settings"]:
        r = s["runs"]
        rows.append(
            f"| {s['name']} | {span(r, 'message_s')} | {span(r, 'first_step_s')} | {span(r, 'cut_node_exit_s')} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--render", action="store_true")
    args = p.parse_args()
    if args.render:
        print(render(json.loads(args.out.read_text())))
    else:
        measure(args.repeats, args.out)


if __name__ == "__main__":
    main()
