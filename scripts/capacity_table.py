"""The capacity table (docs/memory-estimates.md): the largest model each offload policy trains on three boxes.

    python scripts/capacity_table.py            # compute, write docs/results/capacity.json, print the table
    python scripts/capacity_table.py --render   # print the markdown table from the JSON (what the docs embed)

Each box is `zoff estimate configs/gpt-7b.yaml --max-model` (zoff/planning/capacity.py) with that box's GPUs,
GPU memory, host memory and disk: estimates from the functions tests hold equal to the engine's allocations on
CPU, not GPU runs. tests/unit/test_capacity_table.py re-renders the table from the JSON and fails when the
page's copy differs.
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
JSON = REPO / "docs" / "results" / "capacity.json"
BASE = "configs/gpt-7b.yaml"  # context 4096, micro-batch 1, grad_accum 4, bf16
GIB = 2**30
BOXES = [  # (label, GPUs per node, GiB per GPU, GiB of host memory per node, disk bytes, long-sequence switches)
    ("1 x 24 GiB GPU, 128 GiB RAM, 4 TB NVMe", 1, 24, 128, 4 * 10**12, False),
    ("1 x 80 GiB GPU, 1 TiB RAM", 1, 80, 1024, 0, False),
    ("8 x 80 GiB GPUs, 2 TiB RAM", 8, 80, 2048, 0, False),
    # the largest models one 24 GiB GPU trains: with the long-sequence switches (CONTEXT_SWITCHES), and stage 3
    # gathering the layers part by part where whole layers do not fit (memory.fit_gathering; marked *)
    ("1 x 24 GiB GPU, 256 GiB RAM, 8 TB NVMe, tiles + activation offload", 1, 24, 256, 8 * 10**12, True),
]
# The rows: the offload policies with activation checkpointing (what a large model runs with), and plain
# ZeRO-3 as the anchor without offload.
CONTEXT_SWITCHES = "data.batch_size=1 train.loss_tile=4096 train.mlp_tile=4096 train.activation_offload=true"
ROWS = ("zero3", "zero2-offload", "zero3-offload-opt", "zero3-offload", "zero2-nvme", "zero3-nvme")


def compute() -> dict:
    sys.path.insert(0, str(REPO))
    from zoff.config import load_config
    from zoff.planning.capacity import max_model, to_json
    from zoff.planning.memory import Budget

    cfg = load_config(REPO / BASE)
    long = load_config(REPO / BASE, CONTEXT_SWITCHES.split())
    boxes = []
    for label, gpus, gpu_gib, cpu_gib, disk, switches in BOXES:
        budget = Budget(gpu_gib * GIB, cpu_gib * GIB, disk=disk)
        c = long if switches else cfg
        cap = max_model(c.model, c.data, c.train, c.zero, budget, gpus)
        boxes.append({"label": label, "switches": CONTEXT_SWITCHES if switches else "", **to_json(cap)})
    # The context column: the longest sequence gpt-7b (6.7B) trains at on the first box, one sequence per
    # micro-batch with the long-sequence switches (loss and MLP tiles, activation offload; --max-context).
    from dataclasses import replace

    from zoff.planning.context import max_context
    from zoff.planning.context import to_json as context_json

    label, gpus, gpu_gib, cpu_gib, disk, _ = BOXES[0]
    train = replace(cfg.train, activation_checkpointing=True, activation_offload=True, loss_tile=4096,
                    mlp_tile=4096)  # fmt: skip
    ctx = max_context(cfg.model, replace(cfg.data, batch_size=1), train, cfg.zero,
                      Budget(gpu_gib * GIB, cpu_gib * GIB, disk=disk), gpus)  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip() or "unknown",
        "machine": f"{platform.machine()}, {platform.system()} (estimates: no GPU involved)",
        "base_config": BASE,
        "boxes": boxes,
        "context": {"label": label, "switches": CONTEXT_SWITCHES, **context_json(ctx)},
    }


def _cell(policy: dict | None) -> str:
    fit = policy["largest"] if policy else None
    if fit is None:
        return "none"
    size = fit["model"]
    parts = [f"{fit['gpu_bytes'] / GIB:.1f} GiB GPU", f"{fit['cpu_bytes_per_node'] / GIB:,.0f} GiB RAM"]
    if fit["disk_bytes_per_node"]:
        parts.append(f"{fit['disk_bytes_per_node'] / 10**12:.1f} TB disk")
    mark = " \\*" if fit.get("zero_changes") else ""  # gathered part by part (the table's footnote)
    return f"**{size}**{mark} ({', '.join(parts)})"


def render(data: dict) -> str:
    boxes = data["boxes"]
    lines = [
        "| policy (with activation checkpointing) | " + " | ".join(b["label"] for b in boxes) + " |",
        "|---" * (len(boxes) + 1) + "|",
    ]
    for name in ROWS:
        cells = []
        for b in boxes:
            row = next(p for p in b["policies"] if p["name"] == name and p["activation_checkpointing"])
            no_disk = "nvme" in name and not b["memory"]["disk_bytes"]
            cells.append("- (no disk)" if no_disk else _cell(row))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ctx_rows = (data.get("context") or {}).get("policies", [])
    changes = sorted({json.dumps(p["largest"]["zero_changes"]) for b in boxes for p in b["policies"]
                      if p["largest"] and p["largest"].get("zero_changes")}
                     | {json.dumps(p["longest"]["zero_changes"]) for p in ctx_rows
                        if p["longest"] and p["longest"].get("zero_changes")})  # fmt: skip
    switched = [b["label"] for b in boxes if b.get("switches")]
    lines += [""] if changes or switched else []
    if switched:
        lines.append(
            f"{', '.join(switched)}: with `{next(b['switches'] for b in boxes if b.get('switches'))}`."
        )
    if changes:
        yaml = lambda v: f"[{', '.join(v)}]" if isinstance(v, list) else str(v).lower()  # noqa: E731
        keys = " or ".join(
            ", ".join(f"zero.{k}: {yaml(v)}" for k, v in json.loads(c).items()) for c in changes
        )
        lines.append(f"\\* whole layers do not fit; the estimate gathers them part by part: {keys}.")
    ctx = data.get("context")
    if ctx:
        lines += ["", f"| policy (with activation checkpointing) | longest context of 6.7B on {ctx['label']} |",
                  "|---|---|"]  # fmt: skip
        for name in ROWS:
            row = next(p for p in ctx["policies"] if p["name"] == name and p["activation_checkpointing"])
            fit, nvme = row["longest"], "nvme" in name and not ctx["memory"]["disk_bytes"]
            mark = " \\*" if fit and fit.get("zero_changes") else ""  # gathered part by part (the footnote)
            cell = "- (no disk)" if nvme else "none" if fit is None else (
                f"**{fit['seq_len'] // 1024}K tokens**{mark} ({fit['gpu_bytes'] / GIB:.1f} GiB GPU, "
                f"{fit['cpu_bytes_per_node'] / GIB:,.0f} GiB RAM)"
            )  # fmt: skip
            lines.append(f"| {name} | {cell} |")
        lines += [
            "",
            f"The context column: `zoff estimate {data['base_config']} --max-context` with `{ctx['switches']}`.",
        ]
    lines.append("")
    lines.append(
        f"Estimated {data['date']} at commit {data['commit']} from `{data['base_config']}`'s context, batch "
        "and precision (`python scripts/capacity_table.py`; docs/results/capacity.json). Estimates, not GPU runs: held "
        "equal to the engine's allocations by tests on CPU, the activation peaks to an H200's allocator "
        "(docs/gpus.md)."
    )
    return "\n".join(lines) + "\n"


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
