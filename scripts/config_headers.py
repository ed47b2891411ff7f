"""The `zoff estimate` figures each shipped config's header should state, to re-derive stale headers.

A config's header is its leading '#' lines; one that says "zoff estimate: X GiB per GPU ... and Y GiB CPU per
node" quotes the row of `zoff estimate CONFIG` for the policy the config runs (its zero: recipe and
train.activation_checkpointing, on its launch.nproc_per_node GPUs x launch.nnodes' MIN nodes, device cuda).
tests/unit/test_config_headers.py holds the headers to these figures.

Usage:  python scripts/config_headers.py [CONFIG ...]      (default: every configs/*.yaml)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from zoff.config import load_config  # noqa: E402
from zoff.engine.policy import Policy  # noqa: E402
from zoff.planning.memory import GPU_KEYS, estimate  # noqa: E402
from zoff.units import human  # noqa: E402

_SIZE = r"([\d,]+(?:\.\d+)?) ?(B|KiB|MiB|GiB|TiB)"
GPU_CLAIM = re.compile(r"zoff estimate: " + _SIZE + r" per GPU")
CPU_CLAIM = re.compile(_SIZE + r" CPU\b")


def header(path: Path) -> str:
    """The leading comment lines, joined into one line (a claim may wrap across them)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def stated(path: Path) -> dict[str, str] | None:
    """The header's figures as written: {"gpu": "16.8 GiB", "cpu": "100 GiB" or None}; None without a claim."""
    text = header(path)
    m = GPU_CLAIM.search(text)
    if m is None:
        return None
    # the CPU figure, if any, is in the same sentence as the GPU one ("... and 100 GiB CPU per node (...).")
    rest = text[m.end() :]
    end = re.search(r"\.(\s|$)", rest)
    cpu = CPU_CLAIM.search(rest[: end.start() if end else len(rest)])
    return {"gpu": f"{m[1]} {m[2]}", "cpu": f"{cpu[1]} {cpu[2]}" if cpu else None}


def derived(path: Path) -> dict:
    """What `zoff estimate CONFIG` prints for the config's own policy: human() of its GPU and CPU totals."""
    cfg = load_config(path)
    gpus, nodes = cfg.launch.nproc_per_node, cfg.launch.min_nodes
    policy = Policy.of(cfg.zero, cfg.train.activation_checkpointing)
    est = estimate(cfg.model, cfg.data, cfg.train, cfg.zero, gpus, nodes, "cuda")
    pe = est.get(policy)
    return {
        "policy": policy.name + (" + activation checkpointing" if policy.activation_checkpointing else ""),
        "gpus_per_node": gpus,
        "nodes": nodes,
        "gpu": human(pe.gpu_bytes),
        "cpu": human(pe.cpu_bytes_per_node),
        "gpu_parts": {k: human(pe.gpu[k]) for k in GPU_KEYS},
    }


def same_figure(a: str, b: str) -> bool:
    """'100 GiB' states '100.0 GiB' (the same value and unit, to the digits the header prints)."""
    (x, ux), (y, uy) = (s.replace(",", "").split() for s in (a, b))
    return ux == uy and float(x) == float(y)


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((REPO / "configs").glob("*.yaml"))
    stale = 0
    for path in paths:
        claim = stated(path)
        if claim is None:
            continue
        d = derived(path)
        parts = ", ".join(f"{k} {v}" for k, v in d["gpu_parts"].items())
        ok = same_figure(claim["gpu"], d["gpu"]) and (
            claim["cpu"] is None or same_figure(claim["cpu"], d["cpu"])
        )
        stale += not ok
        name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        print(f"{name} ({d['policy']}, {d['gpus_per_node']} GPU(s) x {d['nodes']} node(s), cuda):")
        print(f"  should state: zoff estimate: {d['gpu']} per GPU ({parts}) and {d['cpu']} CPU per node")
        print(
            f"  states:       {claim['gpu']} per GPU, {claim['cpu'] or '-'} CPU  [{'ok' if ok else 'STALE'}]"
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
