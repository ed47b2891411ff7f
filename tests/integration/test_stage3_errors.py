"""What stage 3 cannot support fails loudly, naming the parameter or block, instead of crashing or mixing weights."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import spawn, tiny_cfg
from zoff.config import config_from_dict
from zoff.trainer.loop import train_loop
from zoff.trainer.session import build_session

pytestmark = pytest.mark.slow


class ReadsBlockWeightOutside(nn.Module):
    """The root reads a block's weight outside that block's forward (the block's unit is released there)."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        h = F.linear(h, self.blocks[0].weight)  # outside blocks.0's forward
        return self.head(h)


class RankDependentBlocks(nn.Module):
    """Rank 0 runs block 1 twice and never block 2; rank 1 runs each once: same number of gathers, wrong pairs."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        order = [0, 1, 1] if os.environ.get("RANK") == "0" else [0, 1, 2]
        for i in order:
            h = h + torch.tanh(self.blocks[i](h))
        return self.head(h)


def reads_outside(cfg) -> nn.Module:
    return ReadsBlockWeightOutside(int(cfg.vocab_size), int(cfg.d_model))


def rank_dependent(cfg) -> nn.Module:
    return RankDependentBlocks(int(cfg.vocab_size), int(cfg.d_model))


def _train(rank: int, world: int, cfg_dict: dict) -> str:
    cfg = config_from_dict(cfg_dict)
    s = build_session(cfg, torch.device("cpu"))
    try:
        train_loop(s.engine, s.batches, cfg.train, cfg.schedule, cfg.optim.lr, None, s.comm)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "trained"


def _cfg(factory: str, stage: int) -> dict:
    return tiny_cfg(
        model={
            "name": f"python:tests.integration.test_stage3_errors:{factory}",
            "d_model": 32,
            "vocab_size": 256,
        },
        zero={"stage": stage, "param_persistence_threshold": 0},
        train={"max_steps": 2, "grad_accum": 1},
    )


def test_reading_a_released_parameter_names_it_and_the_reader() -> None:
    stage3 = spawn(_train, 2, _cfg("reads_outside", 3))
    for message in stage3:
        assert message.startswith(
            "UnsupportedModelError: zero.stage 3: parameter 'blocks.0.weight' was read by "
            "module 'ReadsBlockWeightOutside (the model)' outside the forward of 'blocks.0'"
        ), message
    assert spawn(_train, 2, _cfg("reads_outside", 2)) == ["trained", "trained"]  # stage 2 keeps params whole


def test_blocks_run_on_some_ranks_only_are_refused() -> None:
    for message in spawn(_train, 2, _cfg("rank_dependent", 3)):
        assert "UnsupportedModelError: zero.stage 3: block 'blocks." in message, message
        assert "ran on some ranks and not on others" in message
