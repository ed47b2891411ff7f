"""The builtin GPT built on the meta device and materialised by the engine equals the eagerly built one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zoff.config import OptimConfig, ZeroConfig
from zoff.engine import ZeroEngine
from zoff.models.gpt import GPT

SHAPE = dict(n_layer=2, n_head=2, d_model=32, vocab_size=64, seq_len=16)


def _gpt(seed: int, meta: bool) -> GPT:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return GPT(**SHAPE)
    return GPT(**SHAPE)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_meta_model_materialises_to_the_eager_weights(stage: int, precision: str) -> None:
    eager = _gpt(7, meta=False)
    engine = ZeroEngine(_gpt(7, meta=True), ZeroConfig(stage=stage), OptimConfig(), precision=precision)
    got = engine.gathered_params()
    want = dict(eager.named_parameters(remove_duplicate=False))
    assert set(got) == set(want)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    for name, p in want.items():  # masters start from the compute-dtype params, as in the eager path
        assert torch.equal(got[name], p.detach().to(dtype).float()), name
    assert not any(p.is_meta for p in engine.model.parameters())
    assert engine.model.lm_head.weight is engine.model.wte.weight  # the tie survives materialisation
    loss = engine.model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean()
    engine.backward(loss)
    assert engine.step(1e-3).stepped


def test_init_depends_on_seed_and_name_only() -> None:
    a, b, c = _gpt(1, meta=False), _gpt(1, meta=False), _gpt(2, meta=False)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.blocks[0].mlp.fc.weight, c.blocks[0].mlp.fc.weight)
    # Each parameter has its own stream: same-shaped layers do not repeat each other's values.
    assert not torch.equal(a.blocks[0].mlp.fc.weight, a.blocks[1].mlp.fc.weight)
    # GPT-2's scaled init of the residual projections.
    assert a.blocks[0].mlp.proj.weight.std() < 0.7 * a.blocks[0].mlp.fc.weight.std()


def test_meta_model_without_init_parameter_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="init_parameter"):
        ZeroEngine(model, ZeroConfig(stage=1), OptimConfig())
