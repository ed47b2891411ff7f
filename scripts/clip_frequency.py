#!/usr/bin/env python
"""How often the clip triggers in a real run (issue 53): a ~100M GPT trained on the shipped data at
train.grad_clip 1.0, and, from each step's global gradient norm, the fraction of steps after warmup whose
clipping factor is exactly 1 (the steps whose speculated update commits), and what speculate=auto would do.

    python scripts/clip_frequency.py                    # 85M GPT, 3000 steps of 8 x 256 tokens (a GPU: minutes)
    python scripts/clip_frequency.py --steps 1500 --batch 2 --seq-len 128    # what 2 CPU cores do in ~an hour
    python scripts/clip_frequency.py --from-run RUN_DIR # the figures of a run already made (its metrics.jsonl)
    python scripts/clip_frequency.py --render           # the markdown table from the JSON (what the docs embed)

With --noise-batches (default 1, 4, 16 and 64 times --batch sequences; '' for none) the run saves its last step's checkpoint and
the script then measures the final model's gradient norm over batches of those sizes, which says why the run
clips or not and from what batch it would stop (gradient_noise.py; ~B sequences' forward and backward each).

The run is `zoff train configs/quickstart.yaml` with overrides: the quickstart's data (stdlib-source: the standard
library's sources, byte-level) and optimizer (AdamW, betas 0.9/0.95, weight decay 0.1, warmup then cosine to
0.1x), the model at 12 layers x 768 (12 heads: 85M parameters at vocab 256), lr --lr, one rank, zero0 (the norm
is the run's, not the policy's: every policy computes the same norm, which the pattern zoo holds), fp32. The
factor is zoff.engine.precision.clip_factor, the function the engine's step computes it with; auto's rule is the
engine's (Speculation.wanted): a step speculates when the one before it did not clip, and commits when it does
not clip either. A run that stops early (`--from-run` on its folder) gives the figures of the steps it made.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
import gradient_noise
import torch

from zoff.config import derive_grad_accum, load_config
from zoff.engine.precision import clip_factor
from zoff.errors import UserError
from zoff.models import meta_model
from zoff.planning.memory import count_params

JSON = benchlib.RESULTS / "clip_frequency.json"
CONFIG = benchlib.REPO / "configs" / "quickstart.yaml"
MODEL = ["model.n_layer=12", "model.n_head=12", "model.d_model=768"]


def overrides(a: argparse.Namespace) -> list[str]:
    """The run's overrides of the quickstart config (see the module docstring)."""
    return [
        *MODEL, f"model.seq_len={a.seq_len}", f"data.seq_len={a.seq_len}", f"data.batch_size={a.batch}",
        "zero=zero0", "launch.nproc_per_node=1", f"launch.threads_per_rank={a.threads}",
        f"optim.lr={a.lr}", f"schedule.warmup_steps={a.warmup}", f"train.max_steps={a.steps}",
        f"train.grad_clip={a.clip}", "train.precision=fp32", "train.log_every=1", "train.eval_every=0",
        f"checkpoint.enabled={'false' if a.noise_batches == '' else 'true'}", "log.progress=false", *a.overrides,
    ]  # fmt: skip


def train(a: argparse.Namespace, run_dir: Path) -> None:
    """`zoff train` into run_dir, its output passed through (hours on a CPU: the steps show as they go)."""
    cmd = [sys.executable, "-m", "zoff", "train", str(CONFIG), *overrides(a), "--run-dir", str(run_dir)]
    print(" ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"clip_frequency: the run failed; its steps so far: --from-run {run_dir}")


def norms_of(run_dir: Path) -> list[tuple[int, float]]:
    """(step, global gradient norm) of every step the run recorded, in order."""
    return [(r["step"], r["grad_norm"]) for r in benchlib.step_records(run_dir) if "grad_norm" in r]


def clip_figures(norms: list[float], clip: float, warmup: int, windows: int = 5) -> dict:
    """From each step's norm: the fraction of steps after `warmup` whose factor is exactly 1, per window of
    those steps too, what auto would speculate and commit, and the norms' spread after warmup."""
    free = [clip_factor(n, clip) == 1.0 for n in norms]
    after = list(range(warmup, len(norms)))
    if not after:
        raise SystemExit(f"clip_frequency: {len(norms)} steps recorded, none after the warmup's {warmup}")
    # auto (Speculation.wanted): speculate when the step before did not clip; commit when this one does not
    speculated = [t > 0 and free[t - 1] for t in range(len(norms))]
    committed = [speculated[t] and free[t] for t in range(len(norms))]
    size = -(-len(after) // windows)
    parts = [after[i : i + size] for i in range(0, len(after), size)]
    tail = sorted(norms[t] for t in after)

    def share(flags: list[bool], steps: list[int]) -> float:
        return sum(flags[t] for t in steps) / len(steps)

    return {
        "steps": len(norms), "after_warmup": len(after), "unclipped_fraction": share(free, after),
        "windows": [{"from_step": p[0] + 1, "to_step": p[-1] + 1, "unclipped_fraction": share(free, p)}
                    for p in parts],
        "auto_speculated_fraction": share(speculated, after), "auto_committed_fraction": share(committed, after),
        "auto_wasted_fraction": share([s and not f for s, f in zip(speculated, free)], after),
        "norm_after_warmup": {"min": tail[0], "median": statistics.median(tail),
                              "p90": tail[int(0.9 * (len(tail) - 1))], "max": tail[-1]},
        "first_unclipped_step": next((t + 1 for t, f in enumerate(free) if f), None),
    }  # fmt: skip


def render(data: dict) -> str:
    f, n = data["figures"], data["figures"]["norm_after_warmup"]
    rows = [
        f"| steps {w['from_step']}-{w['to_step']} | {w['unclipped_fraction']:.1%} |" for w in f["windows"]
    ]
    stopped = (
        "" if f["steps"] == data["planned_steps"] else f" (stopped early: {data['planned_steps']} planned)"
    )
    return "\n".join([
        f"A {data['params_m']:.1f}M-parameter GPT ({data['layers']} layers x {data['d_model']}) on the quickstart's data, {data['batch']} x"
        f" {data['seq_len']} tokens a step, lr {data['lr']:g}, warmup {data['warmup']}, train.grad_clip"
        f" {data['clip']:g}: {f['steps']} steps{stopped}.",
        "",
        "| steps after warmup | factor exactly 1 (not clipped) |",
        "|---|---:|",
        f"| all {f['after_warmup']} | **{f['unclipped_fraction']:.1%}** |",
        *rows,
        "",
        f"speculate=auto over the steps after warmup (it speculates after a step that did not clip): speculated"
        f" {f['auto_speculated_fraction']:.1%}, committed {f['auto_committed_fraction']:.1%}, speculated and"
        f" discarded {f['auto_wasted_fraction']:.1%}. Norms after warmup: median {n['median']:.3g}, 90th"
        f" percentile {n['p90']:.3g}, range {n['min']:.3g}-{n['max']:.3g}; the first step not clipped:"
        f" {f['first_unclipped_step']}.",
        *(["", *gradient_noise.render_lines(data["noise"], data["clip"], data["seq_len"])] if data.get("noise") else []),
        "",
        benchlib.measured_line(data, "clip_frequency"),
    ])  # fmt: skip


def probe_plan(a: argparse.Namespace) -> list[int]:
    """The probe's batch sizes, checked before hours of training: valid sizes and draws, and run and probe
    within the stream's first epoch (so that the probe reads no window the run read)."""
    default = ",".join(str(k * a.batch) for k in (1, 4, 16, 64))
    sizes = gradient_noise.parse_sizes(default if a.noise_batches is None else a.noise_batches, a.batch)
    if a.noise_draws < 1:
        raise UserError(f"--noise-draws {a.noise_draws}: at least 1")
    if sizes and a.from_run is None:
        cfg = load_config(CONFIG, overrides(a))
        micro = cfg.data.batch_size
        per_step = micro * derive_grad_accum(cfg.train, micro, 1)
        windows = gradient_noise.micro_batches(cfg).num_windows
        gradient_noise.check_one_epoch(a.steps * per_step, sizes, a.noise_draws, windows)
    return sizes


def noise_of(a: argparse.Namespace, sizes: list[int], run_dir: Path) -> dict:
    """gradient_noise's probe of the run's last checkpoint, over the stream's windows after the run's."""
    torch.set_num_threads(a.threads)
    cfg = load_config(CONFIG, overrides(a))
    print(f"clip_frequency: the gradient-noise probe, batches of {sizes} sequences ...", flush=True)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    norms, first = gradient_noise.probe(cfg, ckpt_dir, sizes, a.noise_draws)
    return {"first_sequence": first, "probe_sequences": gradient_noise.probe_sequences(sizes, a.noise_draws),
            "norms": {str(b): ns for b, ns in norms.items()}, "fit": gradient_noise.fit(norms, a.clip, a.seq_len)}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument(
        "--warmup", type=int, default=100, help="schedule.warmup_steps; figures count the steps after"
    )
    ap.add_argument("--batch", type=int, default=8, help="sequences a step (data.batch_size)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2, help="launch.threads_per_rank")
    ap.add_argument(
        "--noise-batches",
        help="the probe's batches, in sequences (default: 1, 4, 16, 64 x --batch; '': no probe)",
    )
    ap.add_argument("--noise-draws", type=int, default=8, help="batches drawn of each size up to 8 sequences")
    ap.add_argument("--from-run", type=Path, help="a run folder already made: its figures, no training")
    ap.add_argument("--keep-run", type=Path, help="train into this folder (kept) instead of a temporary one")
    benchlib.output_args(ap, JSON)
    ap.add_argument("overrides", nargs="*", help="further KEY.PATH=VALUE overrides of the run")
    return ap


def _refuse(why: str) -> int:
    """Bad input (a run folder, its records): one line, exit 2."""
    print(f"clip_frequency: {why}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    if a.from_run is not None and not (a.from_run / "metrics.jsonl").is_file():
        return _refuse(
            f"--from-run {a.from_run}: no metrics.jsonl there (a `zoff train` run folder expected)"
        )
    try:
        sizes = probe_plan(a)
    except UserError as e:
        return _refuse(str(e))
    with tempfile.TemporaryDirectory(prefix="zoff-clip-") as tmp:
        run_dir = a.from_run or a.keep_run or Path(tmp) / "run"
        if a.from_run is None:
            train(a, run_dir)
        recorded = norms_of(run_dir)
        steps, norms = [s for s, _ in recorded], [n for _, n in recorded]
        if steps != list(range(1, len(steps) + 1)):
            return _refuse(f"{run_dir}/metrics.jsonl lacks steps (the run needs train.log_every=1)")
        try:
            figures = clip_figures(norms, a.clip, a.warmup)
        except SystemExit as e:  # (too few steps for --warmup)
            return _refuse(str(e).removeprefix("clip_frequency: "))
        try:
            noise, failed = (noise_of(a, sizes, run_dir) if sizes else None), None
        except UserError as e:  # (no checkpoint in the run folder, another model's, ...)
            noise, failed = None, f"the gradient-noise probe: {e} (--noise-batches '' skips it)"
    if failed and a.from_run is not None:
        return _refuse(failed)  # nothing written: the run's figures are still there to read again
    model = load_config(CONFIG, overrides(a)).model
    params = count_params(meta_model(model))[0]
    data = {
        **benchlib.provenance(), "command": benchlib.command_line(ap, a, "clip_frequency"),
        "config": "configs/quickstart.yaml", "overrides": overrides(a), "planned_steps": a.steps,
        "batch": a.batch, "seq_len": a.seq_len, "lr": a.lr, "warmup": a.warmup, "clip": a.clip,
        "params_m": params / 1e6, "layers": model.n_layer, "d_model": model.d_model, "norms": norms, "figures": figures,
        "noise": noise,
    }  # fmt: skip
    written = benchlib.write_result(a.out, data, render)
    # a fresh run's figures are written without the probe; the run itself is gone unless --keep-run kept it
    return _refuse(failed) if failed else written


if __name__ == "__main__":
    sys.exit(main())
