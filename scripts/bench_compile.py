#!/usr/bin/env python
"""train.compile against eager: the step time of the same model through zoff's engine, compiled block by block
(Inductor's generated CPU code) and not, and what the compile costs (issue 35, item 3).

Not a test. For each model (the quickstart's GPT and a ~100M GPT), one process builds two engines (stage 0,
world 1, fp32, the same weights and batches): one eager, one with its blocks compiled
(zoff.trainer.compile.compile_blocks, as `train.compile: true` does). The first step of each is timed apart
(the compiled one compiles its forward and backward there); then the two take steps in turn, A B A B, and the
table gives the median of the per-round ratios compiled / eager, with each side's median step, the compile
time (first compiled step less a median one) and the steps after which compiling has paid for itself.

    python scripts/bench_compile.py [--rounds 8] [--threads 2]
    python scripts/bench_compile.py --render
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import benchlib  # noqa: E402

JSON = benchlib.RESULTS / "bench_compile.json"

# (label, n_layer, n_head, d_model, vocab, seq, micro-batch): the quickstart's shape and batch, and a GPT of
# ~100M parameters (GPT-2 small's layers with a 32000 vocabulary) at a batch a 2-core step takes seconds on
MODELS = [
    ("quickstart (0.8M)", 4, 4, 128, 256, 128, 8),
    ("GPT 110M", 12, 12, 768, 32000, 256, 2),
]


def _engine(shape: tuple, compiled: bool):
    import torch

    from zoff.config import OptimConfig, ZeroConfig
    from zoff.engine import build_engine
    from zoff.models.gpt import GPT
    from zoff.trainer.compile import compile_blocks

    _, n_layer, n_head, d, vocab, seq, _ = shape
    torch.manual_seed(0)
    eng = build_engine(GPT(n_layer, n_head, d, vocab, seq), ZeroConfig(stage=0), OptimConfig(lr=1e-4))
    if compiled:
        compile_blocks(eng.model, (), "inductor")
    return eng


def _step(eng, x, y) -> tuple[float, float]:
    """(seconds, loss) of one optimizer step: forward, backward, update."""
    from zoff.models import lm_loss

    t0 = time.perf_counter()
    eng.zero_grad()
    loss = lm_loss(eng.model(x), y)
    eng.backward(loss, sync=True)
    eng.step(1e-4)
    return time.perf_counter() - t0, loss.item()


def measure(shape: tuple, rounds: int) -> dict:
    import torch

    vocab, seq, batch = shape[4], shape[5], shape[6]
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(vocab, (rounds + 1, batch, seq + 1), generator=gen)
    eager, compiled = _engine(shape, False), _engine(shape, True)
    first = {}
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    for name, eng in (("eager", eager), ("compiled", compiled)):
        first[name], loss = _step(eng, data[0, :, :-1], data[0, :, 1:])
        losses[name].append(loss)
    for r in range(1, rounds + 1):  # interleaved: the host's speed drifts between modes
        x, y = data[r, :, :-1], data[r, :, 1:]
        for name, eng in (
            (("eager", eager), ("compiled", compiled))
            if r % 2
            else (("compiled", compiled), ("eager", eager))
        ):
            t, loss = _step(eng, x, y)
            times[name].append(t)
            losses[name].append(loss)
    ratios = [c / e for c, e in zip(times["compiled"], times["eager"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    compile_s = first["compiled"] - med["compiled"]
    gain = med["eager"] - med["compiled"]
    params = sum(p.numel() for p in eager.model.parameters())
    return {
        "model": shape[0], "params": params, "tokens_per_step": batch * seq, "rounds": rounds,
        "eager_step_s": med["eager"], "compiled_step_s": med["compiled"],
        "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "first_step_s": first, "compile_s": compile_s,
        "break_even_steps": compile_s / gain if gain > 0 else None,
        "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses["compiled"], losses["eager"])),
    }  # fmt: skip


def render(data: dict) -> str:
    rows = []
    for r in data["results"]:
        even = f"{r['break_even_steps']:.0f}" if r["break_even_steps"] is not None else "never (no gain)"
        rows.append([
            f"{r['model']}, {r['tokens_per_step']:,} tokens/step", f"{r['eager_step_s'] * 1e3:,.0f} ms",
            f"{r['compiled_step_s'] * 1e3:,.0f} ms",
            f"**{r['ratio_median']:.2f}x** ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})",
            f"{r['compile_s']:.0f} s", even, f"{r['max_loss_rel_diff']:.1e}",
        ])  # fmt: skip
    header = ["model", "eager step", "compiled step", "compiled / eager (per-round range)", "compile time",
              "steps to pay it back", "loss rel. diff"]  # fmt: skip
    return benchlib.md_table(header, rows) + "\n" + benchlib.measured_line(data, "bench_compile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="interleaved steps of each side after the first")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the machine's cores)")
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown from --out's JSON")
    a = ap.parse_args()
    if a.render:
        sys.exit(benchlib.print_rendered(a.out, render))
    # A cold compile, as a user's first run has: Inductor's on-disk caches would otherwise serve the kernels a
    # previous run built (a compile time of 0 s).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoff-inductor-")
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    import torch

    torch.set_num_threads(a.threads)
    results = []
    for shape in MODELS:
        results.append(measure(shape, a.rounds))
        print(json.dumps(results[-1]), flush=True)
    data = {**benchlib.provenance(), "command": benchlib.command_line(ap, a, "bench_compile"),
            "threads": a.threads, "results": results}  # fmt: skip
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(render(data))


if __name__ == "__main__":
    main()
