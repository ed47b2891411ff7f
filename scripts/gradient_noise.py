"""The gradient's norm against the batch it is taken over, from a run's last checkpoint (clip_frequency.py's
probe): why a run clips or not at train.grad_clip, and from what batch on it would stop clipping.

A step's global gradient norm |g_B| over B sequences is the mean gradient G plus the noise of B draws:
E|g_B|^2 = |G|^2 + tr(S)/B, S the per-sequence gradients' covariance (McCandlish et al., "An Empirical Model of
Large-Batch Training", 2018: the simple noise scale B_noise = tr(S)/|G|^2). The probe measures |g_B| of the
run's final model, in plain PyTorch (the checkpoint merged by zoff convert, the model built from the run's
config: the norm zoff's engine computes, which the pattern zoo holds equal), for a few B, each over sequences
the run never read (its data stream past its last step), and fits the two terms by least squares on 1/B. The
fit then says at what batch the expected squared norm falls to the clip's square: above it the clip would not
trigger on an average step. The measured norms are the figures; the fit is a model of them, said as such.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from zoff.checkpoint.convert import convert
from zoff.config import Config
from zoff.data import GlobalBatches, load_corpus
from zoff.models import build_model
from zoff.trainer.loss import forward_loss


def parse_sizes(text: str, micro: int) -> list[int]:
    """--noise-batches "2,8,32": sequences a probe batch, each a multiple of the run's data.batch_size (the
    probe reads the run's own micro-batches); [] for ""."""
    sizes = [int(s) for s in text.split(",") if s.strip()]
    bad = [s for s in sizes if s <= 0 or s % micro]
    if bad:
        raise ValueError(
            f"--noise-batches {text}: each size a positive multiple of --batch {micro}, got {bad[0]}"
        )
    return sorted(set(sizes))


def final_model(cfg: Config, run_dir: Path) -> torch.nn.Module:
    """The run's last checkpoint (its checkpoints/ folder) as a plain module of the run's config, fp32."""
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    with tempfile.TemporaryDirectory(prefix="zoff-noise-") as tmp:
        out = Path(tmp) / "model.pt"
        convert(ckpt_dir, out, fmt="pt")
        state = torch.load(out, map_location="cpu", weights_only=True)
    model = build_model(cfg.model)
    model.load_state_dict(state)
    # on the GPU where there is one (the run trained there too): a CPU takes minutes for the larger batches
    return model.float().to("cuda" if torch.cuda.is_available() else "cpu")


def batch_norm(model: torch.nn.Module, batches: GlobalBatches, steps: range) -> float:
    """|g| over the sequences of the run's micro-batches at `steps` (one global batch: each micro-batch's loss
    divided by their count, as the trainer accumulates)."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    for i in steps:
        forward_loss(model, batches.micro_batch_at(i, 0), len(steps), device).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def draws_for(b: int, draws: int) -> int:
    """Batches drawn of B sequences: `draws` up to 8 sequences, fewer above (a larger batch's norm varies
    less; each costs B sequences' forward and backward), at least one."""
    return max(1, min(draws, 8 * draws // b))


def probe(
    cfg: Config, run_dir: Path, sizes: list[int], draws: int, first_step: int
) -> dict[int, list[float]]:
    """{B: [|g_B| of each draw]} of the run's final model, the batches read from the run's stream from step
    `first_step` on, none twice."""
    model = final_model(cfg, run_dir)
    micro = cfg.data.batch_size
    corpus = load_corpus(cfg.data, cfg.train.seed)
    batches = GlobalBatches(corpus, cfg.data.seq_len, micro, 1, 0, 1, cfg.train.seed)
    out, step = {}, first_step
    for b in sizes:
        out[b] = []
        for _ in range(draws_for(b, draws)):
            out[b].append(batch_norm(model, batches, range(step, step + b // micro)))
            step += b // micro
    return out


def fit(norms: dict[int, list[float]], clip: float, tokens_per_sequence: int) -> dict:
    """Least squares of each draw's |g_B|^2 on 1/B: |G|^2 and tr(S) (per sequence), the noise scale, and the
    batch from which the expected squared norm is under clip^2 (None where |G| alone is at or above it)."""
    xs = [1.0 / b for b, ns in norms.items() for _ in ns]
    ys = [n * n for ns in norms.values() for n in ns]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    g2, trace = my - slope * mx, slope
    below = trace / (clip * clip - g2) if g2 < clip * clip and trace > 0 else None
    return {
        "mean_sq_norm": g2, "noise_trace": trace, "noise_scale": trace / g2 if g2 > 0 else None,
        "unclipped_from_sequences": below,
        "unclipped_from_tokens": below * tokens_per_sequence if below is not None else None,
        "by_batch": {str(b): {"draws": len(ns), "median": statistics.median(ns), "min": min(ns), "max": max(ns)}
                     for b, ns in norms.items()},
    }  # fmt: skip


def render_lines(noise: dict, clip: float, seq_len: int) -> list[str]:
    """The probe's rows and its fit, for clip_frequency's table."""
    f = noise["fit"]
    rows = [f"| {int(b):,} ({int(b) * seq_len:,} tokens) | {r['draws']} | {r['median']:.3g} | {r['min']:.3g}-{r['max']:.3g} |"
            for b, r in f["by_batch"].items()]  # fmt: skip
    g = max(f["mean_sq_norm"], 0.0) ** 0.5
    until = (
        f"the expected squared norm falls under the clip's ({clip:g}) from about"
        f" **{f['unclipped_from_sequences']:,.0f} sequences ({f['unclipped_from_tokens']:,.0f} tokens) a step**"
        if f["unclipped_from_sequences"] is not None
        else f"the mean gradient alone ({g:.3g}) is at or above the clip ({clip:g}): no batch would stop it clipping"
    )
    scale = f"{f['noise_scale']:,.0f} sequences" if f["noise_scale"] is not None else "undefined"
    return [
        "The gradient's norm against the batch, at the run's last step (its checkpoint, plain PyTorch, over"
        " sequences the run never read; `scripts/gradient_noise.py`):",
        "",
        "| batch, sequences | draws | norm, median | range |",
        "|---:|---:|---:|---:|",
        *rows,
        "",
        f"Fitted (E|g_B|^2 = |G|^2 + tr(S)/B, least squares over the draws; a model of the rows above, not a"
        f" measurement): |G| {g:.3g}, tr(S) {f['noise_trace']:.3g} per sequence, noise scale tr(S)/|G|^2 {scale};"
        f" {until}.",
    ]
