#!/usr/bin/env python
"""A run of this tree against the same run of an earlier commit, interleaved in one job (issue 32: "a
CPU-offload run, states in RAM, is not slower than today").

    python scripts/bench_vs_commit.py [--base 6b0949f] [--rounds 4] [--steps 5] [--layers 4]
    python scripts/bench_vs_commit.py --render
    python scripts/bench_vs_commit.py --preset demo --base 0061b85 --rounds 2   # the whole demo, ~40 min a round

The earlier commit is checked out in a git worktree beside this one; each round trains the same config in
both trees, in alternating order (A B, B A, ...: this host's memory bandwidth switches modes and other work
shares it), and the result is the median over rounds of the per-round ratio of median steady step times
(this tree / base). The default run is the 3.4B demo's layer shape (configs/gpt-3b-nvme.yaml) with every
state in RAM (zero3-offload: CPU Adam, parameters and optimizer states in host memory) at a few layers: the
CPU-offload path the disk tier's work touched. The default base, 6b0949f, is main when issue 32 was filed.

On a CPU without fast kernels for the demo's bf16 (no AVX512: a bf16 matmul ~100x fp32's time) both trees
train in fp32 (train.precision=fp32: an older tree has no train.cpu_precision; the JSON's cpu_precision and
the table say so); --native-precision keeps bf16, and its hours.

--preset demo runs each tree's own scripts/bench_beyond_memory.py instead (the whole 3.4B demo on disk at the
default host budget, its floor measured in the same job: issue 51's "step / floor before and after"), and
compares step / floor, each tree's step against the floor measured beside it; it writes its own JSON
(bench_vs_commit_demo.json), rendered in `<!-- render: bench_vs_commit --preset demo -->`. This tree's
speculation (issue 53, after the base) is switched off: the demo clips every step, where `auto` computes nothing
but its second slots would take the disk's room the base's fp32 swap files need.
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

PRESETS = {
    "default": benchlib.Preset(benchlib.RESULTS / "bench_vs_commit.json"),
    "demo": benchlib.Preset(benchlib.RESULTS / "bench_vs_commit_demo.json"),
}
JSON = PRESETS["default"].json  # what the bare script writes
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


def demo_run(tree: Path, steps: int, extra: tuple[str, ...] = ()) -> dict:
    """--preset demo: one run of `tree`'s own bench_beyond_memory.py (its package first on the path): its median
    step, the floor it measured in the same job, step / floor, its losses, the job's peak RSS and the disk
    bytes a step; `extra` overrides (keys both trees know) after the script's own."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # this tree's speculation off (the module docstring says why); an older tree has no such key
    knows = "speculate:" in (tree / "zoff" / "config" / "sections.py").read_text()
    own = ["zero.offload_optimizer.speculate=false"] if knows else []
    with tempfile.TemporaryDirectory(prefix="zoff-vs-commit-") as tmp:
        out = Path(tmp) / "demo.json"
        cmd = [sys.executable, "scripts/bench_beyond_memory.py", "--steps", str(steps), "--json", str(out),
               *extra, *own]  # fmt: skip
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if p.returncode != 0 or not out.is_file():  # (no room on the disk: the script exits 0 without a JSON)
            raise SystemExit(f"bench_vs_commit ({tree}): {' '.join(cmd)} wrote no result:\n{p.stdout[-2000:]}"
                             f"{p.stderr[-1500:]}")  # fmt: skip
        d = json.loads(out.read_text())
    if "floor_s" not in d.get("floor", {}):
        raise SystemExit(f"bench_vs_commit ({tree}): the run measured no floor: {d.get('floor_error')}")
    return {"step_s": d["step_time_median_s"], "floor_s": d["floor"]["floor_s"],
            "step_to_floor": d["floor"]["step_to_floor"], "bound": d["floor"]["bound"],
            "losses": [r["loss"] for r in d["steps"]], "peak_rss_job_bytes": d["peak_rss_job_bytes"],
            "disk_read_per_step": d["disk_io_per_step"]["ranks"]["read_per_step"], "overrides": d["overrides"],
            "status": d["status"]}  # fmt: skip


def imports_from(tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import zoff, pathlib; print(pathlib.Path(zoff.__file__).resolve().parent.parent)"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def _losses(data: dict) -> str:
    """The losses sentence: whether every run's losses were the same, or each tree repeats its own."""
    rounds = data["rounds"]
    if data["same_losses"]:
        return "the same in every run, bit for bit"
    if all(
        r["base_losses"] == rounds[0]["base_losses"] and r["head_losses"] == rounds[0]["head_losses"]
        for r in rounds
    ):  # fmt: skip  (each tree repeats itself: the trees compute differently)
        b, h = rounds[0]["base_losses"], rounds[0]["head_losses"]
        rel = max(abs(x - y) / abs(x) for x, y in zip(b, h, strict=True))
        return (f"each tree's the same in every round, bit for bit; the two trees' differ by up to {rel:.1e}"
                " (relative), as a change between them computes differently (see the changelog)")  # fmt: skip
    return "**different**: see the JSON"


def render_demo(data: dict) -> str:
    rows = [f"| {r['round']} | {r['order']} | {r['base']['step_s']:.1f} | {r['base']['floor_s']:.1f} | "
            f"{r['base']['step_to_floor']:.3f} | {r['head']['step_s']:.1f} | {r['head']['floor_s']:.1f} | "
            f"{r['head']['step_to_floor']:.3f} | {r['ratio']:.3f} | {r['step_ratio']:.3f} |"
            for r in data["rounds"]]  # fmt: skip
    return "\n".join([
        f"`{data['config']}` (the whole 3.4B demo, zero3-nvme at the default host budget), {data['steps']} steps"
        f" a run of each tree's own `bench_beyond_memory.py`: this tree ({data['head']}) against {data['base']},"
        " interleaved; step = the run's median step; floor = the larger of compute + CPU Adam (every state in"
        " RAM) and the step's disk bytes at the disk's raw bandwidth, both measured in the same job.",
        "",
        "| round | order | base step, s | base floor, s | base step / floor | this tree step, s | its floor, s"
        " | its step / floor | step / floor: this / base | step: this / base |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Median of the per-round ratios: step / floor **{data['median_ratio']:.3f}**, the step alone"
        f" {data['median_step_ratio']:.3f} (below 1: this tree is faster). Losses: {_losses(data)}.",
        "",
        benchlib.measured_line(data, "bench_vs_commit"),
    ])  # fmt: skip


def render(data: dict) -> str:
    if data.get("preset") == "demo":
        return render_demo(data)
    rows = [f"| {r['round']} | {r['order']} | {r['base_s']:.2f} | {r['head_s']:.2f} | {r['ratio']:.3f} | "
            f"{r['base_opt_s']:.2f} | {r['head_opt_s']:.2f} | {r['opt_ratio']:.3f} |"
            for r in data["rounds"]]  # fmt: skip
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
        f" {_losses(data)}.",
        "",
        benchlib.measured_line(data, "bench_vs_commit"),
    ])  # fmt: skip


def round_row(i: int, order: tuple[str, str], b: dict, h: dict, demo: bool) -> dict:
    """One round's row: this tree (h) against the base (b), each run's losses kept for the losses line."""
    row = {
        "round": i + 1,
        "order": " then ".join(order),
        "base_losses": b["losses"],
        "head_losses": h["losses"],
    }
    if demo:
        return {**row, "base": b, "head": h, "ratio": h["step_to_floor"] / b["step_to_floor"],
                "step_ratio": h["step_s"] / b["step_s"]}  # fmt: skip
    return {**row, "base_s": b["step_s"], "head_s": h["step_s"], "ratio": h["step_s"] / b["step_s"],
            "base_opt_s": b["optimizer_s"], "head_opt_s": h["optimizer_s"],
            "opt_ratio": h["optimizer_s"] / b["optimizer_s"]}  # fmt: skip


def medians(rounds: list[dict], demo: bool) -> dict:
    """The result's medians of the per-round ratios, and whether every run's losses were the same."""
    second = "step_ratio" if demo else "opt_ratio"
    return {"median_ratio": statistics.median(r["ratio"] for r in rounds),
            f"median_{second}": statistics.median(r[second] for r in rounds),
            "same_losses": all(r["base_losses"] == r["head_losses"] == rounds[0]["base_losses"] for r in rounds)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.preset_args(ap, PRESETS)
    ap.add_argument(
        "--base", default="6b0949f", help="the earlier commit (default: main when issue 32 was filed)"
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, help="steps a run (default 5; --preset demo: 6, the demo's figure)")
    ap.add_argument("--layers", type=int, default=4, help="model.n_layer (--preset demo: the whole demo's)")
    benchlib.native_precision_arg(ap)
    a = ap.parse_args(argv)
    benchlib.resolve_output(a, PRESETS)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    demo = a.preset == "demo"
    steps = a.steps or (6 if demo else 5)
    precision = load_config(REPO / CONFIG).train.precision
    cpu = benchlib.cpu_precision_plan(
        "bench_vs_commit", precision, a.native_precision, switch="train.precision=fp32", on_cpu=True
    )
    base = worktree(a.base)
    for tree in (base, REPO):  # the runs must import the tree they are meant to time
        assert Path(imports_from(tree)) == tree.resolve(), tree
    data = {
        **benchlib.provenance(), "command": benchlib.command_line(ap, a, "bench_vs_commit"), "preset": a.preset,
        "config": CONFIG, "steps": steps, "cpu_precision": cpu.to_json(),
        **({"overrides": list(cpu.overrides)} if demo else
           {"layers": a.layers, "overrides": [*OVERRIDES, *cpu.overrides]}),
        "base": subprocess.run(["git", "rev-parse", "--short", a.base], cwd=REPO, capture_output=True,
                               text=True).stdout.strip(),
        "head": benchlib.git_commit(), "rounds": [],
    }  # fmt: skip
    for i in range(a.rounds):
        order = ("base", "head") if i % 2 == 0 else ("head", "base")
        t = {}
        for name in order:
            tree = base if name == "base" else REPO
            t[name] = (demo_run(tree, steps, cpu.overrides) if demo
                       else step_s(tree, a.layers, steps, cpu.overrides))  # fmt: skip
        data["rounds"].append(round_row(i, order, t["base"], t["head"], demo))
        data.update(medians(data["rounds"], demo))
        # after every round: a long run's finished rounds survive its interruption
        a.out.write_text(json.dumps(data, indent=2) + "\n")
        print(f"round {i + 1}: base {t['base']['step_s']:.2f} s, this tree {t['head']['step_s']:.2f} s, "
              f"ratio {data['rounds'][-1]['ratio']:.3f}", flush=True)  # fmt: skip
    print(render(data), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
