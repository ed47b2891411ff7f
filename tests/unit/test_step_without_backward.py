"""A step with no backward since zero_grad: no gradient, so no update and a grad_norm of 0, on every gradient
tier (the shards still hold an earlier window's gradients, which the norm once summed)."""

from __future__ import annotations

import pytest
import torch

from zoff.config import OffloadOptimizerConfig, OptimConfig, OptimizerIoConfig, ZeroConfig
from zoff.engine import build_engine
from zoff.models.gpt import GPT


@pytest.mark.parametrize(
    ("stage", "device", "delay"),
    [(0, "none", False), (2, "cpu", False), (3, "nvme", False), (3, "nvme", True)],
)
def test_a_step_without_backward_changes_nothing_and_reports_no_norm(stage, device, delay, tmp_path) -> None:
    torch.manual_seed(0)
    oo = OffloadOptimizerConfig(
        device=device, nvme_path=str(tmp_path) if device == "nvme" else None, host_budget="min",
        delay_update=delay, io=OptimizerIoConfig(threads=2),
    )  # fmt: skip
    zero = ZeroConfig(stage=stage, offload_optimizer=oo, param_persistence_threshold=64)
    eng = build_engine(GPT(2, 2, 32, 64, 16), zero, OptimConfig(lr=1e-2), precision="bf16", grad_clip=1.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        eng.zero_grad()
        eng.backward(eng.model(torch.randint(0, 64, (2, 16), generator=gen)).float().logsumexp(-1).mean())
        assert eng.step(1e-2).grad_norm > 0
    eng.flush()
    before = eng.gathered_params()
    eng.zero_grad()
    result = eng.step(1e-2)
    eng.flush()
    assert result.grad_norm == 0.0
    after = eng.gathered_params()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    eng.close()
