#!/usr/bin/env python
"""Long sequences on this machine: a small GPT with a 32000-token vocabulary at 16K tokens per sequence, peak
RSS and step time with and without the tiled loss, the tiled MLP and activation offload (issue 34, item 6).

Not a test. Each variant is a real `zoff train` run (one rank, synthetic tokens, the same seed, batches and
init), so its peak RSS is a process's own (summary.json's peak_rss_mib) and its losses are the trainer's.
"plain" is activation checkpointing alone (what a user trains a long context with first); "tiled + offload"
adds train.loss_tile, train.mlp_tile and train.activation_offload. On a CPU-only host the offloaded inputs move
from one host tensor to another, so offload saves no RSS here (it runs, and its results are checked); the
tiles do. The losses of the same steps must agree (tiling changes the order of some sums: within 1e-5).

    python scripts/bench_long_context.py [--seq 16384 --layers 4 --d-model 256 --steps 3]
    python scripts/bench_long_context.py --render
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import benchlib  # noqa: E402

JSON = benchlib.RESULTS / "bench_long_context.json"
VARIANTS = {
    "plain": [],
    "tiled + offload": ["train.loss_tile=2048", "train.mlp_tile=2048", "train.activation_offload=true"],
}


def run(a: argparse.Namespace, extra: list[str], out: Path) -> dict:
    args = [
        f"model.n_layer={a.layers}", f"model.d_model={a.d_model}", f"model.n_head={a.d_model // 64}",
        f"model.vocab_size={a.vocab}", f"model.seq_len={a.seq}", f"data.seq_len={a.seq}", "data.batch_size=1",
        f"data.synthetic_tokens={24 * (a.seq + 1)}", "zero=zero2", "launch.nproc_per_node=1",
        f"train.max_steps={a.steps}", "train.log_every=1", "train.eval_batches=1", "train.precision=fp32",
        "train.activation_checkpointing=true", "log.progress=false", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(a.threads)}
    cmd = [
        sys.executable,
        "-m",
        "zoff",
        "train",
        str(REPO / "configs" / "tiny.yaml"),
        *args,
        "--run-dir",
        str(out),
    ]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_long_context: {' '.join(extra) or 'plain'} failed:\n{p.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "event" not in r]
    return {
        "overrides": extra, "peak_rss_mib": summary["peak_rss_mib"], "losses": [r["loss"] for r in steps],
        "step_s": [r["step_time_s"] for r in steps], "val_loss": summary.get("final_val_loss"),
    }  # fmt: skip


def render(data: dict) -> str:
    v = data["variants"]
    base = v["plain"]
    rows = []
    for name, r in v.items():
        steady = sorted(r["step_s"][1:] or r["step_s"])
        rows.append([
            name, " ".join(f"`{o}`" for o in r["overrides"]) or "activation checkpointing alone",
            f"{r['peak_rss_mib']:,.0f} MiB", f"**{r['peak_rss_mib'] / base['peak_rss_mib']:.2f}x**",
            f"{steady[len(steady) // 2]:.1f} s", " ".join(f"{x:.4f}" for x in r["losses"]),
        ])  # fmt: skip
    m = data["model"]
    head = (
        f"GPT {m['layers']} x {m['d_model']}, vocabulary {m['vocab']:,}, one sequence of {m['seq']:,} tokens per "
        f"step, fp32, activation checkpointing on in both; losses of the same steps differ by at most "
        f"{data['max_loss_rel_diff']:.1e} (relative).\n\n"
    )
    table = benchlib.md_table(
        ["variant", "switches", "peak RSS", "vs plain", "step (median)", "losses"], rows
    )
    return head + table + "\n" + benchlib.measured_line(data, "bench_long_context")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown from --out's JSON")
    a = ap.parse_args()
    if a.render:
        sys.exit(benchlib.print_rendered(a.out, render))
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            name: run(a, extra, Path(tmp) / str(i)) for i, (name, extra) in enumerate(VARIANTS.items())
        }
    plain, tiled = variants["plain"]["losses"], variants["tiled + offload"]["losses"]
    diff = max(abs(x - y) / abs(y) for x, y in zip(tiled, plain))
    data = {
        **benchlib.provenance(), "command": benchlib.command_line(ap, a, "bench_long_context"),
        "model": {"layers": a.layers, "d_model": a.d_model, "vocab": a.vocab, "seq": a.seq}, "threads": a.threads,
        "variants": variants, "max_loss_rel_diff": diff,
        "rss_ratio": variants["tiled + offload"]["peak_rss_mib"] / variants["plain"]["peak_rss_mib"],
    }  # fmt: skip
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(render(data))


if __name__ == "__main__":
    main()
