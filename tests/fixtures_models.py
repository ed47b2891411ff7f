"""Tiny model factories for tests, usable as `model.name: python:tests.fixtures_models:<factory>`.

Each factory receives the config's `model` section (a `zoff.config.ModelConfig`, or anything with
`vocab_size` and `d_model` attributes) and returns an `nn.Module` whose `forward(idx)` maps token ids
(B, T) to logits (B, T, vocab_size).
"""

from __future__ import annotations

import os

import torch
from torch import nn


class DeltaLinear(nn.Linear):
    """A Linear whose weight is `weight + delta.view(...)` with a flat `delta`.

    Autograd hands `delta` a gradient that is a view of the one `weight` has yet to receive, so a reducer
    that scales gradients in place corrupts `weight`'s.
    """

    def __init__(self, d: int):
        super().__init__(d, d)
        self.delta = nn.Parameter(torch.zeros(d * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight * 1.0 + self.delta.view(self.weight.shape)  # the view second: its gradient runs first
        return nn.functional.linear(x, w, self.bias)


class TiedFrozen(nn.Module):
    """The awkward cases a ZeRO engine must get right, in one small model.

    - `emb.weight` is shared with the output projection `head.weight` (tied: one parameter, two names);
    - `frozen` is a Linear whose parameters have requires_grad=False (never updated, never in the optimizer);
    - `shared` is one Linear called twice per forward (its gradient accumulates from two uses);
    - `scale` is a registered buffer (state that is not a parameter);
    - `fc2` adds a flat parameter to its weight through a view (DeltaLinear).
    """

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model)
        self.fc1 = nn.Linear(d_model, d_model)
        self.frozen = nn.Linear(d_model, d_model)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(d_model, d_model)
        self.fc2 = DeltaLinear(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_model))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) * self.scale
        h = h + torch.tanh(self.fc1(h))
        h = h + 0.5 * self.frozen(h)
        h = h + torch.tanh(self.shared(h))
        h = h + torch.tanh(self.shared(h))  # the same module a second time
        h = self.fc2(h)
        return self.head(h)


def tied_frozen(cfg) -> nn.Module:
    """A TiedFrozen model sized by `cfg.vocab_size` and `cfg.d_model`."""
    return TiedFrozen(int(cfg.vocab_size), int(cfg.d_model))


def boom(cfg) -> nn.Module:
    """Fails inside launched workers only (LOCAL_RANK is set there), so the CLI's preflight build passes."""
    if "LOCAL_RANK" in os.environ:
        raise RuntimeError("boom")
    return tied_frozen(cfg)
