"""Activation memory of the builtin GPT on a GPU, measured, beside what `zoff estimate` says for it.

    python scripts/gpu_activation_check.py [--out FILE.json] [--quick]

For each case (model shape, micro-batch, checkpointing, loss tile) the model is built in bf16 on the GPU, its
parameter gradients allocated by one warm-up step (they are the plan's "grads" column, not activations), then
one forward + backward is measured with the CUDA allocator: `saved` = bytes allocated after the forward above
that baseline (what autograd keeps), `peak` = the allocator's peak during forward and backward above it. The
estimate's figures (zoff.planning.activations.gpt_activations) are printed beside them with their ratio. Needs
a CUDA device (the CPU has no allocator peak to read); writes JSON for docs/gpus.md, with the date, commit and
machine (the GPU's name beside benchlib.machine()'s) every results JSON carries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # zoff, without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, when a test loads this file by its path

import benchlib  # noqa: E402

from zoff.config import ModelConfig  # noqa: E402
from zoff.data.batch import MicroBatch  # noqa: E402
from zoff.models.gpt import GPT  # noqa: E402
from zoff.planning.activations import gpt_activations  # noqa: E402
from zoff.trainer.loss import forward_loss  # noqa: E402

JSON = Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu_activation_check.json"

# (label, n_layer, n_head, d_model, vocab, seq, batch, checkpointing, loss_tile)
CASES = [
    ("gpt2-124m", 12, 12, 768, 50304, 1024, 1, False, 0),
    ("gpt2-124m", 12, 12, 768, 50304, 1024, 8, False, 0),
    ("gpt2-124m", 12, 12, 768, 50304, 1024, 32, False, 0),
    ("gpt2-124m", 12, 12, 768, 50304, 1024, 8, True, 0),
    ("gpt2-124m", 12, 12, 768, 50304, 1024, 32, True, 0),
    ("gpt2-124m", 12, 12, 768, 50304, 1024, 8, False, 4096),
    ("gpt2-124m", 12, 12, 768, 50304, 1024, 32, True, 4096),
    ("blocks-only", 12, 12, 768, 256, 1024, 8, False, 0),
    ("blocks-only", 12, 12, 768, 256, 1024, 8, True, 0),
    ("wide", 4, 16, 2048, 32000, 2048, 4, False, 0),
    ("wide", 4, 16, 2048, 32000, 2048, 4, True, 0),
    ("wide", 4, 16, 2048, 32000, 2048, 4, True, 8192),
]


def model_config(row: dict) -> ModelConfig:
    """The ModelConfig of a measured row (heads do not change the arithmetic; d_model / 64 of them)."""
    return ModelConfig(
        name="gpt", n_layer=row["n_layer"], n_head=max(1, row["d_model"] // 64), d_model=row["d_model"],
        vocab_size=row["vocab"], seq_len=row["seq"],
    )  # fmt: skip


def current_estimate(row: dict):
    """What gpt_activations says for a measured row today (the JSON keeps what it said when measured)."""
    return gpt_activations(
        model_config(row), row["batch"], row["seq"], "bf16", row["checkpointing"], "cuda", row["loss_tile"]
    )


def render(data: dict) -> str:
    """docs/gpus.md's table: each case measured on the GPU beside today's estimate."""
    mib = lambda b: f"{b / (1 << 20):,.0f}"  # noqa: E731
    md = [
        "bf16 on the GPU, MiB above the parameters and their gradients; the estimate is today's "
        "zoff.planning.activations (the measurement's date and commit are below).",
        "",
        "| model (layers x d, vocab) | seq x batch | checkpointing | loss tile | saved: measured | estimate "
        "| peak: measured | estimate | estimate / measured |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["results"]:
        if "error" in r:
            continue
        est = current_estimate(r)
        md.append(
            f"| {r['case']} ({r['n_layer']} x {r['d_model']}, {r['vocab']}) | {r['seq']} x {r['batch']} | "
            f"{'on' if r['checkpointing'] else 'off'} | {r['loss_tile'] or '-'} | {mib(r['measured_saved'])} | "
            f"{mib(est.saved)} | {mib(r['measured_peak'])} | {mib(est.peak)} | "
            f"{est.peak / r['measured_peak']:.3f} |"
        )
    if data.get("recorded_from"):  # a run from before the script recorded its date and commit
        md += ["", f"The date and commit below are from {data['recorded_from']}."]
    return "\n".join(md) + "\n\n" + benchlib.measured_line(data, "gpu_activation_check")


def measure(case: tuple, dev: torch.device) -> dict:
    label, n_layer, n_head, d, vocab, seq, batch, ckpt, tile = case
    torch.manual_seed(0)
    model = GPT(n_layer, n_head, d, vocab, seq).to(dev, torch.bfloat16).train()
    model.activation_checkpointing = ckpt
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(vocab, (batch, seq + 1), generator=gen)
    mb = MicroBatch(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())

    def step() -> None:
        forward_loss(model, mb, 1, dev, tile).backward()

    step()  # allocates every .grad (kept, zeroed in place: the baseline holds them)
    for p in model.parameters():
        p.grad.zero_()
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    loss = forward_loss(model, mb, 1, dev, tile)
    torch.cuda.synchronize(dev)
    saved = torch.cuda.memory_allocated(dev) - base
    fwd_peak = torch.cuda.max_memory_allocated(dev) - base
    loss.backward()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    row = {
        "case": label, "n_layer": n_layer, "d_model": d, "vocab": vocab, "seq": seq, "batch": batch,
        "checkpointing": ckpt, "loss_tile": tile, "measured_saved": saved, "measured_forward_peak": fwd_peak,
        "measured_peak": peak,
    }  # fmt: skip
    est = current_estimate(row)
    return {**row, "estimate_saved": est.saved, "estimate_peak": est.peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default="runs/gpu_activation_check.json", help=f"copy a run worth keeping to {JSON}"
    )
    ap.add_argument("--quick", action="store_true", help="the first three cases only")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_activation_check: no CUDA device visible to torch", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    rows = []
    gib = 1 << 30
    print(
        f"{'case':12} {'L':>3} {'d':>5} {'vocab':>6} {'seq':>5} {'b':>3} ckpt tile  saved/est   peak/est (GiB)"
    )
    for case in CASES[:3] if a.quick else CASES:
        try:
            r = measure(case, dev)
            torch.cuda.empty_cache()  # the case's model and activations, freed as measure() returned
        except torch.OutOfMemoryError as e:
            r = {"case": case[0], "error": f"out of memory: {e}"}
            print(r)
            rows.append(r)
            continue
        rows.append(r)
        print(
            f"{r['case']:12} {r['n_layer']:>3} {r['d_model']:>5} {r['vocab']:>6} {r['seq']:>5} {r['batch']:>3} "
            f"{'on ' if r['checkpointing'] else 'off'}  {r['loss_tile']:>4} "
            f"{r['measured_saved'] / gib:6.2f}/{r['estimate_saved'] / gib:<6.2f} "
            f"{r['measured_peak'] / gib:6.2f}/{r['estimate_peak'] / gib:<6.2f} "
            f"(forward peak {r['measured_forward_peak'] / gib:.2f})",
            flush=True,
        )
    data = {
        **benchlib.provenance(),
        "command": benchlib.command_line(ap, a, "gpu_activation_check"),
        "results": rows,
    }
    data["machine"]["gpu"] = torch.cuda.get_device_name(dev)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
