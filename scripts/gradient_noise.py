"""The gradient's norm against the batch it is taken over, at a run's last checkpoint (clip_frequency.py's
probe): how far the run's clipping comes from the batch's noise, and at what batch the norm's root mean square
would fall under train.grad_clip.

A step's global gradient norm |g_B| over B sequences is the mean gradient G plus the noise of B draws:
E|g_B|^2 = |G|^2 + tr(S)/B, S the per-sequence gradients' covariance (McCandlish et al., "An Empirical Model of
Large-Batch Training", 2018: the simple noise scale B_noise = tr(S)/|G|^2). The probe measures |g_B| of the
run's final model in plain PyTorch, fp32 (the checkpoint merged by zoff convert, the model built from the run's
config: the norm zoff's engine computes, which the pattern zoo holds equal), for a few B, over the windows
that follow the run's last in its data stream (its checkpoint says where that is): windows the run never read,
as long as run and probe stay within the stream's first epoch, which the probe checks. It fits the two terms by
least squares on 1/B, weighted by B (a larger batch's squared norm varies less). The fit gives the batch B*
where |G|^2 + tr(S)/B* = clip^2: there the RMS norm is at the clip, so about half the steps still clip (a
batch several times B* clips rarely), and it is the final weights' (|G| is larger earlier in a run). The
measured norms are the figures; the fit is a model of them, said as such.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from zoff.checkpoint.convert import convert
from zoff.checkpoint.format import find_checkpoint, read_manifest
from zoff.config import Config
from zoff.data import GlobalBatches, load_corpus
from zoff.errors import UserError
from zoff.models import build_model
from zoff.trainer.loss import forward_loss


def parse_sizes(text: str, micro: int) -> list[int]:
    """--noise-batches "2,8,32": sequences a probe batch, at least two sizes (a fit needs two), each a multiple
    of the run's data.batch_size (the probe reads the run's own micro-batches); [] for ""."""
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise UserError(f"--noise-batches {text!r}: expected sizes in sequences, as 2,8,32") from None
    bad = [s for s in sizes if s <= 0 or s % micro]
    if bad:
        raise UserError(
            f"--noise-batches {text}: each size a positive multiple of --batch {micro}, got {bad[0]}"
        )
    if len(sizes) == 1 or (not sizes and text.strip()):
        raise UserError(
            f"--noise-batches {text}: at least two sizes (the fit's two terms), or '' for no probe"
        )
    return sizes


def draws_for(b: int, draws: int) -> int:
    """Batches drawn of B sequences: `draws` up to 8 sequences, fewer above (a larger batch's norm varies
    less; each costs B sequences' forward and backward), at least one."""
    return max(1, min(draws, 8 * draws // b))


def probe_sequences(sizes: list[int], draws: int) -> int:
    return sum(b * draws_for(b, draws) for b in sizes)


def check_one_epoch(first: int, sizes: list[int], draws: int, windows: int) -> None:
    """The run's sequences and the probe's within the stream's first epoch: otherwise the probe's windows are
    ones the run trained on in an earlier epoch (each epoch permutes the same windows)."""
    end = first + probe_sequences(sizes, draws)
    if end > windows:
        raise UserError(
            f"--noise-batches: the run reads {first:,} sequences and the probe {end - first:,} more, past the "
            f"stream's first epoch ({windows:,} windows): the probe would measure windows the run trained on; "
            "fewer --steps or smaller --noise-batches"
        )


def final_model(cfg: Config, ckpt_dir: Path) -> tuple[torch.nn.Module, dict]:
    """The newest checkpoint in ckpt_dir as a plain module of `cfg`'s model, fp32, and its manifest."""
    ckpt = find_checkpoint(str(ckpt_dir), Path("."), label="the run's checkpoints")
    with tempfile.TemporaryDirectory(prefix="zoff-noise-") as tmp:
        out = Path(tmp) / "model.pt"
        convert(ckpt, out, fmt="pt")
        state = torch.load(out, map_location="cpu", weights_only=True)
    model = build_model(cfg.model)
    try:
        model.load_state_dict(state)
    except RuntimeError:
        raise UserError(
            f"{ckpt}: its weights are not the model these arguments build (the run's own?)"
        ) from None
    # on the GPU where there is one (the run trained there too): a CPU takes minutes for the larger batches
    return model.float().to("cuda" if torch.cuda.is_available() else "cpu"), read_manifest(ckpt, verify=False)


def batch_norm(model: torch.nn.Module, batches: GlobalBatches, steps: range) -> float:
    """|g| over the sequences of the micro-batches at `steps` (one global batch: each micro-batch's mean token
    loss divided by their count, as the trainer accumulates)."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    for i in steps:
        mb = batches.micro_batch_at(i, 0)
        if mb.loss_divisor is not None:  # (fine-tuning data: the loss is not each micro-batch's mean)
            raise UserError(
                "--noise-batches: the probe reads text windows; this run's data is not a text corpus"
            )
        forward_loss(model, mb, len(steps), device).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def micro_batches(cfg: Config) -> GlobalBatches:
    """The run's stream one micro-batch (data.batch_size sequences) a step, as one rank without accumulation
    reads it: micro_batch_at(k, 0) holds its sequences k * micro .. (k + 1) * micro - 1."""
    micro = cfg.data.batch_size
    return GlobalBatches(
        load_corpus(cfg.data, cfg.train.seed), cfg.data.seq_len, micro, 1, 0, 1, cfg.train.seed
    )


def probe(cfg: Config, ckpt_dir: Path, sizes: list[int], draws: int) -> tuple[dict[int, list[float]], int]:
    """({B: [|g_B| of each draw]}, the first sequence read) of the newest checkpoint's model, the batches read
    from the run's stream from where the checkpoint's step left it, none twice."""
    model, manifest = final_model(cfg, ckpt_dir)
    data = manifest["trainer"]["data"]
    first = manifest["trainer"]["step"] * data["global_batch"]
    micro = cfg.data.batch_size
    batches = micro_batches(cfg)
    check_one_epoch(first, sizes, draws, batches.num_windows)
    out, step = {}, first // micro  # (the global batch is a multiple of the micro-batch)
    for b in sizes:
        out[b] = []
        for _ in range(draws_for(b, draws)):
            out[b].append(batch_norm(model, batches, range(step, step + b // micro)))
            step += b // micro
    return out, first


def fit(norms: dict[int, list[float]], clip: float, tokens_per_sequence: int) -> dict:
    """Least squares, weighted by B, of each draw's |g_B|^2 on 1/B: |G|^2 and tr(S) (per sequence), the noise
    scale, and B* where the fitted mean squared norm is clip^2 (see `verdict` for the cases without one)."""
    pts = [(1.0 / b, n * n, b) for b, ns in norms.items() for n in ns]
    w = sum(b for _, _, b in pts)
    mx, my = (sum(b * p[k] for *p, b in pts) / w for k in (0, 1))
    sxx = sum(b * (x - mx) ** 2 for x, _, b in pts)
    trace = sum(b * (x - mx) * (y - my) for x, y, b in pts) / sxx
    g2 = my - trace * mx
    room = clip * clip - max(g2, 0.0)  # |G|^2 is not negative: a fit below 0 gives B*'s lower bound
    b_star = trace / room if trace > 0 and room > 0 else None
    return {
        "mean_sq_norm": g2, "noise_trace": trace, "noise_scale": trace / g2 if g2 > 0 and trace > 0 else None,
        "rms_under_clip_from_sequences": b_star,
        "rms_under_clip_from_tokens": b_star * tokens_per_sequence if b_star is not None else None,
        "by_batch": {str(b): {"draws": len(ns), "median": statistics.median(ns), "min": min(ns), "max": max(ns)}
                     for b, ns in norms.items()},
    }  # fmt: skip


def verdict(f: dict, clip: float) -> str:
    """What the fit says of B*, in each of its cases."""
    g2, trace, b = f["mean_sq_norm"], f["noise_trace"], f["rms_under_clip_from_sequences"]
    if trace <= 0:
        return "the squared norm does not fall with the batch in these draws: no noise term resolved, no B*"
    if g2 >= clip * clip:
        return f"|G|^2 alone is at or above clip^2 ({clip:g}^2): at these weights no batch brings the RMS norm under it"
    tokens = f"{b:,.0f} sequences ({f['rms_under_clip_from_tokens']:,.0f} tokens) a step"
    if g2 <= 0:
        return f"|G|^2 not resolved (the fit gives {g2:.3g}): the RMS norm reaches the clip at B* of at least {tokens}"
    return (
        f"the RMS norm reaches the clip ({clip:g}) at B* of about **{tokens}**; at B* about half the steps still"
        " clip, and B* is the final weights' (|G| is larger earlier in a run)"
    )


def render_lines(noise: dict, clip: float, seq_len: int) -> list[str]:
    """The probe's rows and its fit, for clip_frequency's table."""
    f = noise["fit"]
    rows = [f"| {int(b):,} ({int(b) * seq_len:,} tokens) | {r['draws']} | {r['median']:.3g} | {r['min']:.3g}-{r['max']:.3g} |"
            for b, r in f["by_batch"].items()]  # fmt: skip
    scale = f"{f['noise_scale']:,.0f} sequences" if f["noise_scale"] is not None else "not resolved"
    return [
        "The gradient's norm against the batch at the run's last checkpoint (plain PyTorch, fp32, over the"
        f" {noise['probe_sequences']:,} windows after the run's {noise['first_sequence']:,} in its stream's"
        " first epoch: none the run read; `scripts/gradient_noise.py`):",
        "",
        "| batch, sequences | draws | norm, median | range |",
        "|---:|---:|---:|---:|",
        *rows,
        "",
        f"Fitted (E|g_B|^2 = |G|^2 + tr(S)/B, least squares over the draws weighted by B; a model of the rows"
        f" above, with one draw at the largest sizes, not a measurement): |G|^2 {f['mean_sq_norm']:.3g}, tr(S)"
        f" {f['noise_trace']:.3g} per sequence, noise scale tr(S)/|G|^2 {scale}; {verdict(f, clip)}.",
    ]
