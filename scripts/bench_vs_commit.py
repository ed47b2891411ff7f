#!/usr/bin/env python
"""A run of this tree against the same run of an earlier commit, interleaved in one job (issue 32: "a
CPU-offload run, states in RAM, is not slower than today").

    python scripts/bench_vs_commit.py [--base 6b0949f] [--rounds 4] [--steps 5] [--layers 4]
    python scripts/bench_vs_commit.py --render

The earlier commit is checked out in a git worktree beside this one; each round trains the same config in
both trees, in alternating order (A B, B A, ...: this host's memory bandwidth switches modes and other work
shares it), and the result is the median over rounds of the per-round ratio of median steady step times
(this tree / base). The default run is the 3.4B demo's layer shape (configs/gpt-3b-nvme.yaml) with every
state in RAM (zero3-offload: CPU Adam, parameters and optimizer states in host memory) at a few layers: the
CPU-offload path the disk tier's work touched. The default base, 6b0949f, is main when issue 32 was filed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from offload_floor import _steady_step_s

JSON = benchlib.RESULTS / "bench_vs_commit.json"
REPO = Path(__file__).resolve().parents[1]
CONFIG = "zoff/configs/gpt-3b-nvme.yaml"  # each tree's own copy (keys differ between commits)
# keys both trees know: every state in RAM, no checkpoint, a time per step
OVERRIDES = [
    "zero.offload_optimizer.device=cpu",
    "zero.offload_param.device=cpu",
    "checkpoint.enabled=false",
    "train.log_every=1",
    "train.eval_batches=1",
    "launch.nproc_per_node=1",
    "log.progress=false",
]


def worktree(rev: str) -> Path:
    """A checkout of `rev` beside the repo (made once, reused)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    path = Path(tempfile.gettempdir()) / f"zoff-base-{sha}"
    if not (path / "zoff").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
    return path


def step_s(tree: Path, layers: int, steps: int) -> float:
    """The median steady step time of one run in `tree` (its own package first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="zoff-vs-") as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "zoff", "train", str(tree / CONFIG), *OVERRIDES, f"model.n_layer={layers}",
               f"train.max_steps={steps}", "--run-dir", str(run)]  # fmt: skip
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(
                f"bench_vs_commit: the run in {tree} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}"
            )
        return _steady_step_s(run)


def imports_from(tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import zoff, pathlib; print(pathlib.Path(zoff.__file__).resolve().parent.parent)"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def render(data: dict) -> str:
    rows = [f"| {r['round']} | {r['order']} | {r['base_s']:.2f} | {r['head_s']:.2f} | {r['ratio']:.3f} |"
            for r in data["rounds"]]  # fmt: skip
    return "\n".join([
        f"`{data['config']}` at {data['layers']} layers, every state in RAM (zero3-offload), {data['steps']} steps "
        f"a run: this tree ({data['head']}) against {data['base']}, interleaved.",
        "",
        "| round | order | base step, s | this tree step, s | this / base |",
        "|---:|---|---:|---:|---:|",
        *rows,
        "",
        f"Median of the per-round ratios: **{data['median_ratio']:.3f}** (below 1: this tree is faster).",
        "",
        benchlib.measured_line(data, "bench_vs_commit"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--base", default="6b0949f", help="the earlier commit (default: main when issue 32 was filed)"
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", type=Path, default=JSON, dest="out")
    ap.add_argument("--render", action="store_true", help="only print the table from --json")
    a = ap.parse_args(argv)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    base = worktree(a.base)
    for tree in (base, REPO):  # the runs must import the tree they are meant to time
        assert Path(imports_from(tree)) == tree.resolve(), tree
    rounds = []
    for i in range(a.rounds):
        order = ("base", "head") if i % 2 == 0 else ("head", "base")
        t = {name: step_s(base if name == "base" else REPO, a.layers, a.steps) for name in order}
        rounds.append({"round": i + 1, "order": " then ".join(order), "base_s": t["base"], "head_s": t["head"],
                       "ratio": t["head"] / t["base"]})  # fmt: skip
        print(f"round {i + 1}: base {t['base']:.2f} s, this tree {t['head']:.2f} s", flush=True)
    data = {
        **benchlib.provenance(),
        "command": benchlib.command_line(ap, a, "bench_vs_commit"),
        "config": CONFIG, "layers": a.layers, "steps": a.steps, "overrides": OVERRIDES,
        "base": subprocess.run(["git", "rev-parse", "--short", a.base], cwd=REPO, capture_output=True,
                               text=True).stdout.strip(),
        "head": benchlib.git_commit(),
        "rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
    }  # fmt: skip
    a.out.write_text(json.dumps(data, indent=2) + "\n")
    print(render(data), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
