#!/usr/bin/env python
"""One long sequence over N ranks (train.sequence_parallel, issue 55): tokens per second, the all-to-all's
share of the step and peak RSS per rank at N = 1, 2 and 4, for one sequence of 16K tokens of a small GPT.

Not a test. Each cell is a real `zoff train` run of world N with one sequence per step (the global batch is
the same at every N: one sequence, same seed, init and data), so its losses must agree across N within 1e-5
(fp32) and its peak RSS is each rank's own. The runs are interleaved (N = 1, 2, 4, then again) and each
ratio is the median of per-round ratios, as this host's bandwidth modes demand. The exchange's share is rank
0's seconds inside the all-to-alls (metrics.jsonl's sequence_exchange_s, waits for peers included) over its
step time. Threads per rank: the host's cores over N, at least 1; on a host with fewer cores than 4 ranks the
N = 4 ranks share cores, which the table says.

    python scripts/bench_sequence_parallel.py [--seq 16384 --layers 2 --d-model 128 --steps 3 --rounds 2]
    python scripts/bench_sequence_parallel.py --render
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import benchlib  # noqa: E402

JSON = benchlib.RESULTS / "bench_sequence_parallel.json"
SHARDS = (1, 2, 4)


def run(a: argparse.Namespace, n: int) -> dict:
    """One `zoff train` of world n, every rank one of n shards of the step's one sequence."""
    threads = max(1, (os.cpu_count() or 1) // n)
    args = [
        f"model.n_layer={a.layers}", f"model.d_model={a.d_model}", f"model.n_head={a.heads}",
        f"model.seq_len={a.seq}", f"data.seq_len={a.seq}", "data.batch_size=1",
        f"data.synthetic_tokens={24 * (a.seq + 1)}", "zero=zero2", f"launch.nproc_per_node={n}",
        f"train.sequence_parallel={n}", "train.global_batch_size=1", f"train.max_steps={a.steps}",
        "train.log_every=1", "train.eval_batches=1", "train.precision=fp32", "log.progress=false",
        "checkpoint.enabled=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    steps, summary = benchlib.train_run(
        REPO / "configs" / "tiny.yaml", args, f"bench_sequence_parallel N={n}", cwd=REPO, env=env
    )
    steady = steps[1:] or steps  # the first step pays for warm-up
    step_s = statistics.median(r["step_time_s"] for r in steady)
    exchange_s = statistics.median(r.get("sequence_exchange_s", 0.0) for r in steady)
    sent = statistics.median(r.get("sequence_exchange_elements", 0) for r in steady)
    return {
        "n": n, "threads_per_rank": threads, "losses": [r["loss"] for r in steps], "step_s": step_s,
        "tokens_per_s": a.seq / step_s, "exchange_s": exchange_s, "exchange_share": exchange_s / step_s,
        "exchange_elements": sent,
        "peak_rss_mib": max(summary["peak_rss_mib_per_rank"]),
    }  # fmt: skip


def render(data: dict) -> str:
    m = data["model"]
    rows = []
    for n in map(str, data["shards"]):
        c = data["cells"][n]
        rows.append([
            n, f"{m['seq'] // int(n):,}", str(c["threads_per_rank"]), f"{c['tokens_per_s']:,.0f}",
            f"**{data['speedup'][n]:.2f}x**", f"{c.get('exchange_elements', 0) / 1e6:.1f}M",
            f"{int(n) * c.get('exchange_elements', 0) / 1e6:.1f}M", f"{100 * c['exchange_share']:.1f}%",
            f"{c['peak_rss_mib']:,.0f} MiB",
        ])  # fmt: skip
    head = (
        f"GPT {m['layers']} x {m['d_model']} ({m['heads']} heads), one sequence of {m['seq']:,} tokens per step, "
        f"fp32, world N = train.sequence_parallel N, {data['rounds']} interleaved rounds of {data['steps']} steps "
        f"(medians; ratios are medians of per-round ratios). Losses agree across N within "
        f"{data['max_loss_rel_diff']:.1e} (relative). {data['cores']} cores: ranks beyond them share cores.\n\n"
    )
    table = benchlib.md_table(
        [
            "N",
            "tokens per rank",
            "threads/rank",
            "tokens/s",
            "vs N=1",
            "sent a rank and step",
            "sent by the group",
            "all-to-all share",
            "peak RSS/rank",
        ],  # fmt: skip
        rows,
    )
    return head + table + "\n" + benchlib.measured_line(data, "bench_sequence_parallel")


def _summarise(a: argparse.Namespace, rounds: list[dict]) -> dict:
    cells = {}
    for n in SHARDS:
        got = [r[n] for r in rounds]
        cells[str(n)] = {
            **got[-1],
            **{k: statistics.median(g[k] for g in got) for k in ("step_s", "tokens_per_s", "exchange_s")},
            "exchange_share": statistics.median(g["exchange_share"] for g in got),
            "peak_rss_mib": max(g["peak_rss_mib"] for g in got),
            "rounds_step_s": [g["step_s"] for g in got],
        }
    speedup = {
        str(n): statistics.median(r[n]["tokens_per_s"] / r[1]["tokens_per_s"] for r in rounds) for n in SHARDS
    }
    base = rounds[0][1]["losses"]
    diff = max(abs(x - y) / abs(y) for r in rounds for n in SHARDS for x, y in zip(r[n]["losses"], base))
    return {"cells": cells, "speedup": speedup, "max_loss_rel_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown from --out's JSON")
    a = ap.parse_args()
    if a.render:
        sys.exit(benchlib.print_rendered(a.out, render))
    rounds = []
    for k in range(a.rounds):
        rounds.append({n: run(a, n) for n in SHARDS})
        print(
            f"round {k + 1}: " + ", ".join(f"N={n} {rounds[-1][n]['step_s']:.1f} s" for n in SHARDS),
            flush=True,
        )
    data = {
        **benchlib.provenance(), "command": benchlib.command_line(ap, a, "bench_sequence_parallel"),
        "model": {"layers": a.layers, "d_model": a.d_model, "heads": a.heads, "seq": a.seq},
        "shards": list(SHARDS), "steps": a.steps, "rounds": a.rounds, "cores": os.cpu_count(),
        **_summarise(a, rounds),
    }  # fmt: skip
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(render(data))


if __name__ == "__main__":
    main()
