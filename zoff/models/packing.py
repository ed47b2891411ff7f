"""Whether a model keeps packed examples apart, decided by what it does rather than by reading its source.

Packing puts several fine-tuning examples into one sequence, with position_ids that restart at each; the model
must then let no token attend across an example's start. Whether it does is a property of its attention code,
its mask builder and its transformers version, which no name or signature says. So a tiny twin of the model
(twin.py) runs a packed pair of examples and each example alone: the model packs when the pair's outputs equal
the lone runs'. The verdict is cached (twin.cached_verdict)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from zoff.models.twin import Verdict, base_of, cached_verdict, output_tensor, vocab_of

LENGTHS = (5, 7)  # the pair: unequal, so a mask that ignores position_ids cannot pass by symmetry


def packs_examples(model: nn.Module) -> Verdict:
    """Whether `model` (real, meta or wrapped by peft) keeps packed examples apart."""
    base = base_of(model)
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return Verdict(False, f"{type(base).__name__}.forward takes no position_ids")
    return cached_verdict("packing", base, probe)


@torch.no_grad()
def probe(model: nn.Module) -> Verdict:
    """Run a packed pair of examples and each example alone; equal outputs: the model keeps them apart."""
    model.eval()
    g = torch.Generator().manual_seed(0)
    positions = [torch.arange(n).unsqueeze(0) for n in LENGTHS]
    try:
        alone = [torch.randint(0, vocab_of(model), (1, n), generator=g) for n in LENGTHS]
        packed = output_tensor(model(torch.cat(alone, 1), position_ids=torch.cat(positions, 1)))
        each = [output_tensor(model(x, position_ids=p)) for x, p in zip(alone, positions, strict=True)]
    except Exception as e:  # noqa: BLE001 - any failure to run packed is a model that does not pack
        return Verdict(False, f"it fails on packed input ({type(e).__name__}: {str(e)[:120]})")
    for i, (got, want) in enumerate(zip(packed.split(LENGTHS, 1), each, strict=True)):
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            where = "the second example attends to the first" if i else "the first example changes"
            return Verdict(False, f"packed, {where} (max difference {float((got - want).abs().max()):.2g})")
    return Verdict(True, "")
