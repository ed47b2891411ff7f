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

On a CPU without fast kernels for the demo's bf16 (no AVX512: a bf16 matmul ~100x fp32's time) both trees
train in fp32 (train.precision=fp32: an older tree has no train.cpu_precision; the JSON's cpu_precision and
the table say so); --native-precision keeps bf16, and its hours.
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

from zoff.config import load_config

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


def step_s(tree: Path, layers: int, steps: int, extra: tuple[str, ...] = ()) -> dict:
    """One run in `tree` (its own package first on the path): its median steady step time, the median of its
    optimizer phase (metrics.jsonl's optimizer_s: the step less forward and backward) and its losses; `extra`
    overrides (keys both trees know) after OVERRIDES."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # a tree whose demo turns the overlapped step on (it needs parameters on disk) gets it off, as states in RAM
    # have no walk to overlap; an older tree's config has no such key to set
    own = (
        ["zero.offload_optimizer.overlap_step=false"]
        if "overlap_step:" in (tree / CONFIG).read_text()
        else []
    )
    overrides = [*OVERRIDES, *extra, *own, f"model.n_layer={layers}", f"train.max_steps={steps}"]
    steps_rows = benchlib.train_records(
        tree / CONFIG, overrides, f"bench_vs_commit ({tree})", cwd=tree, env=env
    )
    steady = steps_rows[1:] or steps_rows
    return {"step_s": statistics.median(r["step_time_s"] for r in steady),
            "optimizer_s": statistics.median(r.get("optimizer_s", 0.0) for r in steady),
            "losses": [r["loss"] for r in steps_rows]}  # fmt: skip


def imports_from(tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import zoff, pathlib; print(pathlib.Path(zoff.__file__).resolve().parent.parent)"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def render(data: dict) -> str:
    rows = [f"| {r['round']} | {r['order']} | {r['base_s']:.2f} | {r['head_s']:.2f} | {r['ratio']:.3f} | "
            f"{r['base_opt_s']:.2f} | {r['head_opt_s']:.2f} | {r['opt_ratio']:.3f} |"
            for r in data["rounds"]]  # fmt: skip
    same = "the same in every run, bit for bit" if data["same_losses"] else "**different**: see the JSON"
    rounds = data["rounds"]
    if not data["same_losses"] and all(
        r["base_losses"] == rounds[0]["base_losses"] and r["head_losses"] == rounds[0]["head_losses"]
        for r in rounds
    ):  # each tree repeats itself: the trees compute differently (a correction between them)
        b, h = rounds[0]["base_losses"], rounds[0]["head_losses"]
        rel = max(abs(x - y) / abs(x) for x, y in zip(b, h, strict=True))
        same = (f"each tree's the same in every round, bit for bit; the two trees' differ by up to {rel:.1e}"
                " (relative), as a change between them computes differently (see the changelog)")  # fmt: skip
    return "\n".join([
        f"`{data['config']}` at {data['layers']} layers, every state in RAM (zero3-offload), {data['steps']} steps "
        f"a run: this tree ({data['head']}) against {data['base']}, interleaved.",
        "",
        "| round | order | base step, s | this tree step, s | this / base | base optimizer phase, s | this tree's, s"
        " | this / base |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Median of the per-round ratios: step **{data['median_ratio']:.3f}**, optimizer phase (the step less"
        f" forward and backward) **{data['median_opt_ratio']:.3f}** (below 1: this tree is faster). Losses:"
        f" {same}.",
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
    benchlib.output_args(ap, JSON)
    benchlib.native_precision_arg(ap)
    a = ap.parse_args(argv)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    precision = load_config(REPO / CONFIG).train.precision
    cpu = benchlib.cpu_precision_plan(
        "bench_vs_commit", precision, a.native_precision, switch="train.precision=fp32", on_cpu=True
    )
    base = worktree(a.base)
    for tree in (base, REPO):  # the runs must import the tree they are meant to time
        assert Path(imports_from(tree)) == tree.resolve(), tree
    rounds = []
    for i in range(a.rounds):
        order = ("base", "head") if i % 2 == 0 else ("head", "base")
        t = {
            name: step_s(base if name == "base" else REPO, a.layers, a.steps, cpu.overrides) for name in order
        }
        b, h = t["base"], t["head"]
        rounds.append({"round": i + 1, "order": " then ".join(order), "base_s": b["step_s"],
                       "head_s": h["step_s"], "ratio": h["step_s"] / b["step_s"], "base_opt_s": b["optimizer_s"],
                       "head_opt_s": h["optimizer_s"], "opt_ratio": h["optimizer_s"] / b["optimizer_s"],
                       "base_losses": b["losses"], "head_losses": h["losses"]})  # fmt: skip
        print(f"round {i + 1}: base {b['step_s']:.2f} s (optimizer {b['optimizer_s']:.2f}), this tree "
              f"{h['step_s']:.2f} s ({h['optimizer_s']:.2f})", flush=True)  # fmt: skip
    data = {
        **benchlib.provenance(),
        "command": benchlib.command_line(ap, a, "bench_vs_commit"),
        "config": CONFIG, "layers": a.layers, "steps": a.steps, "overrides": [*OVERRIDES, *cpu.overrides],
        "cpu_precision": cpu.to_json(),
        "base": subprocess.run(["git", "rev-parse", "--short", a.base], cwd=REPO, capture_output=True,
                               text=True).stdout.strip(),
        "head": benchlib.git_commit(),
        "rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "median_opt_ratio": statistics.median(r["opt_ratio"] for r in rounds),
        "same_losses": all(r["base_losses"] == r["head_losses"] == rounds[0]["base_losses"] for r in rounds),
    }  # fmt: skip
    a.out.write_text(json.dumps(data, indent=2) + "\n")
    print(render(data), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
