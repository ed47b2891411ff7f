"""Stage 3 partitions frozen parameters like the others (no gradient, no optimizer state): a LoRA-style model
whose frozen base is most of its weights trains like plain PyTorch, each rank holds 1/N of the base, and its
checkpoints carry the base in the shard files, loadable at any world size and stage and by `zoff convert`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.harness import (
    assert_close_losses,
    assert_close_params,
    reference_run,
    run_zoff,
    run_zoff_many,
    tiny_cfg,
)
from zoff.checkpoint.convert import convert
from zoff.config import config_from_dict
from zoff.engine.footprint import frozen_param_bytes
from zoff.engine.policy import engine_plan
from zoff.models import meta_model

pytestmark = pytest.mark.slow


class LoRABlock(nn.Module):
    """A frozen base projection plus a trainable low-rank update (x @ A @ B), as LoRA adapters are."""

    def __init__(self, d: int, rank: int = 4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.base = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.base.requires_grad_(False)
        self.out.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(d, rank) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(rank, 4 * d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.out(torch.tanh(self.base(h) + h @ self.lora_a @ self.lora_b))


class LoRALM(nn.Module):
    def __init__(self, vocab: int, d: int, n: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.emb.requires_grad_(False)  # a frozen root parameter too
        self.blocks = nn.ModuleList(LoRABlock(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def lora(cfg) -> nn.Module:
    return LoRALM(int(cfg.vocab_size), int(cfg.d_model), int(cfg.n_layer))


MODEL = {
    "name": "python:tests.integration.test_frozen_partition:lora",
    "d_model": 32,
    "vocab_size": 256,
    "n_layer": 3,
}


def _cfg(stage: int, steps: int = 10, ckpt: Path | None = None, every: int = 0) -> dict:
    extra = {"checkpoint": {"dir": str(ckpt), "every_steps": every, "keep_last": 5}} if ckpt else {}
    return tiny_cfg(
        model=MODEL,
        zero={"stage": stage, "param_persistence_threshold": 64},
        train={"max_steps": steps, "grad_accum": 1, "global_batch_size": 12},
        data={"batch_size": 2},
        **extra,
    )


def test_frozen_base_is_partitioned_and_trains_like_the_reference() -> None:
    cfg = config_from_dict(_cfg(3))
    plan = engine_plan(meta_model(cfg.model), 3, 2, cfg.zero)
    assert plan.frozen_units, "stage 3 must partition the frozen base"
    ref = reference_run(cfg, 2)
    got = run_zoff_many([_cfg(3), _cfg(2)], 2)
    for r in got:
        assert_close_losses(r["losses"], ref["losses"])
        assert_close_params(r["params"], ref["params"])
    whole = sum(p.numel() for p in lora(cfg.model).parameters() if not p.requires_grad) * 4
    stage3 = got[0]["memory"]["frozen_params"]
    assert stage3 == frozen_param_bytes(meta_model(cfg.model), plan, "fp32")  # estimate == engine
    assert stage3 <= 0.55 * whole, (stage3, whole)  # each of 2 ranks holds about half of the base
    assert got[1]["memory"]["frozen_params"] == whole  # stage 2 keeps it whole


def test_frozen_shards_survive_checkpoints_and_convert(tmp_path: Path) -> None:
    full = run_zoff(_cfg(3, 10, tmp_path / "a", 5), 2, tmp_path)[0]
    step5 = tmp_path / "a" / "step_00000005"
    # Stage 3 on 3 ranks (re-partitioned base) and stage 2 on 3 ranks (base whole again) both continue.
    for stage, sub in ((3, "b"), (2, "c")):
        r = run_zoff(_cfg(stage, 10, tmp_path / sub, 0), 3, tmp_path, str(step5))[0]
        assert r["start"] == 5
        assert_close_losses(r["losses"], full["losses"][5:])
    # ... and a stage-2 checkpoint (base in extra.safetensors) resumes at stage 3 (base partitioned).
    run_zoff(_cfg(2, 10, tmp_path / "d", 5), 2, tmp_path)
    r = run_zoff(_cfg(3, 10, tmp_path / "e", 0), 2, tmp_path, str(tmp_path / "d" / "step_00000005"))[0]
    assert_close_losses(r["losses"], full["losses"][5:])
    out = tmp_path / "export.pt"
    convert(step5, out, fmt="pt")
    exported = torch.load(out)
    torch.manual_seed(0)  # the harness builds the model with the run's seed: the frozen base never changes
    model = lora(config_from_dict(_cfg(3)).model)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(exported[name], p.detach()), name
