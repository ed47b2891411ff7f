"""A node's link cut mid-run (tests/netns.py's namespaces, one `zoff train` agent in each): what the tests in
tests/integration/test_network_cut.py assert on and what scripts/measure_network_cut.py times. Node 0 hosts
the rendezvous store; the last node is the one cut. Times are seconds from the cut, read by polling the
agents' stderr and metrics.jsonl every 0.1 s."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from tests.netns import Nodes
from tests.processes import Agent, last_step, records, wait_for

# One rank thread, a fixed global batch (the same losses at every world size), a checkpoint every 10 steps.
COMMON = ("zero=zero2", "launch.threads_per_rank=1", "train.log_every=1", "train.global_batch_size=16")
CHECKPOINT_EVERY = 10
PORT = 29400  # inside namespaces of their own: no other process can hold it
LOST_NODE = re.compile(r"^zoff: lost node (\S+) \(ranks? ([\d,]+)\): no heartbeat for .*$", re.M)
LOST_OTHERS = re.compile(
    r"^zoff: lost the other nodes: the rendezvous store at (\S+) has not answered .*$", re.M
)


def config(steps: int, *extra: str) -> tuple[str, ...]:
    return (*COMMON, f"train.max_steps={steps}", f"checkpoint.every_steps={CHECKPOINT_EVERY}", *extra)


def start_nodes(
    start: Callable[..., Agent], nodes: Nodes, run_dir: Path, cfg: tuple[str, ...]
) -> list[Agent]:
    """One agent per namespace, --nnodes 1:N, one rank each; returns them once every rank has started."""
    n = len(nodes.names)
    flags = ("--nnodes", f"1:{n}", "--nproc-per-node", "1", "--rdzv-endpoint", f"{nodes.address(0)}:{PORT}")
    out = [
        start(run_dir, *cfg, *flags, "--max-restarts", "1", name=f"node{i}", prefix=tuple(nodes.prefix(i)))
        for i in range(n)
    ]
    wait_for(
        lambda: "world size " + str(n) in out[0].stdout, f"a {n}-rank job", out[0], timeout=240, every=0.2
    )
    return out


def after_resume(run_dir: Path) -> dict | None:
    """The first step record after the (first) resume event in metrics.jsonl, or None."""
    seen = False
    for r in records(run_dir):
        seen = seen or r.get("event") == "resume"
        if seen and "loss" in r and "event" not in r:
            return r
    return None


def cut_and_time(agents: list[Agent], nodes: Nodes, run_dir: Path, cut_after: int, timeout: float) -> dict:
    """Cut the last node's link after step `cut_after`; the seconds from the cut until the survivor's line,
    until its first step after re-forming and until the cut-off node exits (None: not within `timeout`)."""
    survivor, cut = agents[0], agents[-1]
    wait_for(lambda: last_step(run_dir) >= cut_after, f"step {cut_after}", survivor, timeout=240)
    nodes.cut(len(agents) - 1)
    t0 = time.monotonic()
    out = {"cut_step": last_step(run_dir), "message_s": None, "first_step_s": None, "cut_node_exit_s": None}
    while time.monotonic() - t0 < timeout and None in out.values():
        now = round(time.monotonic() - t0, 1)
        if out["message_s"] is None and LOST_NODE.search(survivor.stderr):
            out["message_s"] = now
        if out["first_step_s"] is None and after_resume(run_dir):
            out["first_step_s"] = now
        if out["cut_node_exit_s"] is None and cut.proc.poll() is not None:
            out["cut_node_exit_s"] = now
        time.sleep(0.1)
    return out


def blip(agents: list[Agent], nodes: Nodes, run_dir: Path, cut_after: int, down_s: float) -> int:
    """Cut the last node's link after step `cut_after` for `down_s` seconds, then bring it back; the step
    reached at the cut."""
    wait_for(lambda: last_step(run_dir) >= cut_after, f"step {cut_after}", agents[0], timeout=240)
    nodes.cut(len(agents) - 1)
    at = last_step(run_dir)
    try:
        time.sleep(down_s)
    finally:
        nodes.restore(len(agents) - 1)
    return at
