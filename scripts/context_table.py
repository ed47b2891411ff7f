"""The long-context table (docs/memory-estimates.md): the longest sequence configs/gpt-7b.yaml trains at on one,
eight and 32 80 GiB GPUs, each sequence split over the GPUs (train.sequence_parallel), with its learned position
table and with rotary positions (model.positions), beside ALST's figures.

    python scripts/context_table.py            # compute, write docs/results/context_sp.json, print the table
    python scripts/context_table.py --render   # print the markdown table from the JSON (what the docs embed)

Each box is `zoff estimate configs/gpt-7b.yaml --max-context` (zoff/planning/context.py) with the long-sequence
switches and that box's GPUs, nodes and train.sequence_parallel: estimates from the functions tests hold equal
to the engine's allocations on CPU (tests/integration/test_sequence_parallel_estimate.py), not GPU runs. Where a
box has a target length, the estimate at the target says what fits or is over: the GPU bytes of the policy that
reaches furthest, by category, and what the activations' peak is made of. tests/unit/test_sequence_parallel_estimate.py
re-renders the table from the JSON and fails when the page's copy differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JSON = REPO / "docs" / "results" / "context_sp.json"
BASE = "configs/gpt-7b.yaml"  # 6.7B: 32 layers x 4096, 32 heads, vocab 32000, learned positions, bf16
# model.positions: the config's learned table (seq_len x d_model parameters), and rotary (none)
POSITIONS = ("learned", "rotary")
GIB = 2**30
RAM_GIB = 2048  # host memory per node, every box
SWITCHES = (
    "data.batch_size=1 train.loss_tile=4096 train.mlp_tile=4096 train.activation_checkpointing=true "
    "train.activation_offload=true"
)
# (label, GPUs per node, nodes, train.sequence_parallel, ALST's figure for Llama-8B on that many H100 80GB,
# the length the issue asks of the box: 0 for none)
BOXES = [
    ("1 x 80 GiB GPU", 1, 1, 1, "500K", 0),
    ("8 x 80 GiB GPUs, each sequence on 1", 8, 1, 1, "-", 0),
    ("8 x 80 GiB GPUs (1 node), each sequence on 8", 8, 1, 8, "3.7M", 4 << 20),
    ("32 x 80 GiB GPUs (4 nodes of 8), each sequence on 32", 8, 4, 32, "15M", 16 << 20),
]
ROWS = ("zero3", "zero2-offload", "zero3-offload-opt", "zero3-offload")  # with checkpointing; no disk tier
ALST = (
    "ALST (Arctic Long Sequence Training, arXiv 2506.13996): Llama-8B, measured on H100 80GB: 500K tokens on one, "
    "3.7M on one node of 8, 15M on four nodes (32)"
)


def compute() -> dict:
    sys.path.insert(0, str(REPO))
    boxes = []
    for label, gpus, nodes, n, alst, target in BOXES:
        box = {"label": label, "alst": alst}
        for positions in POSITIONS:
            cfg = _config(n, positions)
            box[positions] = _box(cfg, gpus, nodes)
            box[positions]["target"] = _at_target(cfg, box[positions], target) if target else None
        boxes.append(box)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip() or "unknown",
        "machine": f"{platform.machine()}, {platform.system()} (estimates: no GPU involved)",
        "base_config": BASE,
        "switches": SWITCHES,
        "ram_gib_per_node": RAM_GIB,
        "alst": ALST,
        "boxes": boxes,
    }


def _config(n: int, positions: str):
    from zoff.config import load_config

    return load_config(
        REPO / BASE, [*SWITCHES.split(), f"train.sequence_parallel={n}", f"model.positions={positions}"]
    )


def _box(cfg, gpus: int, nodes: int) -> dict:
    from zoff.planning.context import max_context, to_json
    from zoff.planning.memory import Budget

    return to_json(
        max_context(cfg.model, cfg.data, cfg.train, cfg.zero, Budget(80 * GIB, RAM_GIB * GIB), gpus, nodes)
    )


def _at_target(cfg, box: dict, seq: int) -> dict:
    """The box's furthest policy at `seq` tokens: whether it fits, its GPU bytes by category, the part of
    stage 3's buffers that is the learned position table (model.seq_len x d_model, gathered whole with the
    embeddings, and its gradient: 2 x 2 B x seq x d_model in bf16; none with rotary positions), and what the
    activations' peak is: the bytes saved for backward and the moment on top (the all-to-all's where it is the
    largest)."""
    import dataclasses

    from zoff.engine.policy import Policy
    from zoff.planning.activations import activations
    from zoff.planning.capacity import limited_by
    from zoff.planning.memory import Budget, estimate_to_fit

    rows = [p for p in box["policies"] if p["longest"]]
    best = max(rows, key=lambda p: p["longest"]["seq_len"])
    m, d, t = (
        dataclasses.replace(cfg.model, seq_len=seq),
        dataclasses.replace(cfg.data, seq_len=seq),
        cfg.train,
    )
    budget = Budget(80 * GIB, RAM_GIB * GIB)
    est = estimate_to_fit(m, d, t, cfg.zero, box["gpus_per_node"], box["nodes"], "cuda", budget)
    pe = est.get(Policy(best["stage"], best["offload_optimizer"], best["offload_param"], True))
    act = activations(
        m,
        d,
        t.precision,
        True,
        "cuda",
        t.loss_tile,
        t.activation_offload,
        t.mlp_tile,
        False,
        t.sequence_parallel,
    )  # (as the row's: checkpointing on, bf16 on a GPU)
    assert act.peak == pe.gpu["activations"]
    return {
        "seq_len": seq, "policy": best["name"], "fits": pe.fits(budget), "limited_by": limited_by(pe, budget),
        "gpu_bytes": pe.gpu_bytes, "gpu": dict(pe.gpu), "cpu_bytes_per_node": pe.cpu_bytes_per_node,
        "position_table_bytes": 2 * 2 * seq * m.d_model if m.positions == "learned" else 0,
        "exchange_bytes": est.exchange, "activations_saved": act.saved,
        "exchange_sets_peak": act.peak == act.exchange_peak, "tokens_per_gpu": seq // t.sequence_parallel,
    }  # fmt: skip


def _tokens(n: int) -> str:
    """Tokens as the table prints them: 4.2M, 553K."""
    return f"{n / 2**20:.1f}M" if n >= 2**20 else f"{n // 1024}K"


def _cell(policy: dict) -> str:
    fit = policy["longest"]
    if fit is None:
        return "none"
    mark = " \\*" if fit.get("zero_changes") else ""  # gathered part by part (the table's footnote)
    return (
        f"**{_tokens(fit['seq_len'])}**{mark} ({fit['gpu_bytes'] / GIB:.1f} GiB GPU, "
        f"{fit['cpu_bytes_per_node'] / GIB:,.0f} GiB RAM/node)"
    )


def render(data: dict) -> str:
    boxes = data["boxes"]
    lines = [
        "| policy (with activation checkpointing), model.positions | "
        + " | ".join(b["label"] for b in boxes)
        + " |",
        "|---" * (len(boxes) + 1) + "|",
    ]
    for positions in POSITIONS:
        for name in ROWS:
            row = [
                next(
                    p for p in b[positions]["policies"] if p["name"] == name and p["activation_checkpointing"]
                )
                for b in boxes
            ]
            lines.append(f"| {name}, {positions} | " + " | ".join(_cell(p) for p in row) + " |")
    lines.append("| ALST, Llama-8B on H100 80GB (measured) | " + " | ".join(b["alst"] for b in boxes) + " |")
    targets = [(b, pos) for b in boxes for pos in POSITIONS if b[pos]["target"]]
    lines += ["", *(_target_line(b, pos) for b, pos in targets)]
    if any(
        p["longest"] and p["longest"].get("zero_changes")
        for b in boxes
        for pos in POSITIONS
        for p in b[pos]["policies"]
    ):
        lines.append(
            "\\* stage 3 with its layers gathered part by part (`zero.block_classes`), the estimate's own choice."
        )
    lines += [
        "",
        f"`zoff estimate {data['base_config']} --max-context --gpu-memory 80GiB --cpu-memory {data['ram_gib_per_node']}GiB "
        f"--gpus-per-node G --nodes K {data['switches']} train.sequence_parallel=N model.positions=P`, "
        f"{data['ram_gib_per_node'] // 1024} TiB of RAM per node, no disk tier. {data['alst']}; zoff's are estimates. "
        f"Estimated {data['date']} at commit {data['commit']} (`python scripts/context_table.py`; "
        "docs/results/context_sp.json).",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _target_line(box: dict, positions: str) -> str:
    """What the box needs at its target length with these positions, by category, and what is over."""
    t = box[positions]["target"]
    g, table, gib = t["gpu"], t["position_table_bytes"], lambda b: f"{b / GIB:.1f} GiB"
    verdict = "fits" if t["fits"] else f"does not fit ({', '.join(t['limited_by'])} over)"
    of_table = (
        f" (of it {gib(table)} the learned position table, {_tokens(t['seq_len'])} x d_model, gathered whole with "
        "the embeddings, and its gradient)"
        if table
        else " (no position table)"
    )
    moment = g["activations"] - t["activations_saved"]
    peak = "the last layer's all-to-all in backward" if t["exchange_sets_peak"] else "a backward moment"
    return (
        f"At {_tokens(t['seq_len'])} tokens on {box['label']} ({_tokens(t['tokens_per_gpu'])} a GPU), {positions} "
        f"positions, {t['policy']} {verdict}: {gib(t['gpu_bytes'])} a GPU = stage-3 buffers {gib(g['buffers'])}"
        f"{of_table} + activations {gib(g['activations'])} ({gib(t['activations_saved'])} saved, and {gib(moment)} "
        f"at {peak}, of it {gib(t['exchange_bytes'])} its send and receive buffers) + parameters "
        f"{gib(g['params'])}"
        + (f"; all but the position table: {gib(t['gpu_bytes'] - table)}" if table else "")
        + f". {t['cpu_bytes_per_node'] / GIB:,.0f} GiB of RAM a node."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only render the table from the JSON")
    a = ap.parse_args(argv)
    if not a.render:
        JSON.parent.mkdir(parents=True, exist_ok=True)
        JSON.write_text(json.dumps(compute(), indent=1) + "\n")
    sys.stdout.write(render(json.loads(JSON.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
