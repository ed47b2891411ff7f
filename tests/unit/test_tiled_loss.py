"""The tiled loss (train.loss_tile, issue 34 item 2): the output head and cross-entropy a tile of positions at a
time equal the untiled loss and gradients (up to the order of a sum), with answer-only masks and packing; a
model whose logits are changed after its head is refused by a try on its tiny twin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zoff.data.batch import IGNORE, MicroBatch
from zoff.models.gpt import GPT
from zoff.models.head import head_replaced, output_head
from zoff.trainer.loss import forward_loss, loss_tiles, tiled_cross_entropy

REPO = Path(__file__).resolve().parents[2]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Within 1e-6 of the reference's largest magnitude: sums taken in another order, nothing more."""
    err = float((got - want).abs().max())
    assert err <= 1e-6 * max(float(want.abs().max()), 1e-30), f"{what}: max abs diff {err}"


@pytest.mark.parametrize("tile", [1, 5, 37, 100])
def test_tiles_equal_the_whole_cross_entropy_and_its_gradients(tile: int) -> None:
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50)
    t = torch.randint(0, 50, (37,))
    t[[3, 9, 36]] = IGNORE
    want = F.cross_entropy(head(h).float(), t, ignore_index=IGNORE, reduction="sum")
    want_g = torch.autograd.grad(want, [h, head.weight, head.bias])
    got = tiled_cross_entropy(h, head, t, tile)
    got_g = torch.autograd.grad(got, [h, head.weight, head.bias])
    assert_close(got, want, "loss")
    for a, b, what in zip(got_g, want_g, ("hidden", "weight", "bias"), strict=True):
        assert_close(a, b, what)


def _batch(sft: bool) -> MicroBatch:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 16), generator=g)
    y = torch.randint(0, 64, (2, 16), generator=g)
    if not sft:
        return MicroBatch(x, y)
    y[:, :5] = IGNORE  # the prompts' positions are not trained
    pos = torch.cat([torch.arange(7), torch.arange(9)]).repeat(2, 1)  # two packed examples per row
    return MicroBatch(x, y, position_ids=pos, loss_divisor=13.0)


@pytest.mark.parametrize("sft", [False, True], ids=["pretraining", "packed-answers-only"])
def test_forward_loss_tiled_equals_untiled_for_the_gpt(sft: bool) -> None:
    torch.manual_seed(0)
    model = GPT(2, 2, 16, 64, 16)  # tied: the head's weight is the embedding's
    batch = _batch(sft)
    losses, grads = [], []
    for tile in (0, 6):
        model.zero_grad()
        loss = forward_loss(model, batch, 2, torch.device("cpu"), tile)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert_close(losses[1], losses[0], "loss")
    for name, g in grads[0].items():
        assert_close(grads[1][name], g, name)
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head is back after the headless forward


def test_the_head_is_restored_even_on_error() -> None:
    model = GPT(2, 2, 16, 64, 16)
    head = output_head(model)
    with pytest.raises(RuntimeError), head_replaced(model, head, torch.nn.Identity()):
        assert isinstance(model.lm_head, torch.nn.Identity)
        raise RuntimeError("boom")
    assert model.lm_head is head


def test_a_model_whose_logits_change_after_the_head_is_refused(tmp_path, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("ZOFF_CACHE_DIR", str(tmp_path))
    assert loss_tiles(GPT(2, 2, 16, 64, 16)).ok
    gemma = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, vocab_size=96)
    )  # fmt: skip
    v = loss_tiles(gemma)  # final_logit_softcapping: tanh after the head
    assert not v.ok and v.why == "its logits are changed after the output head (a soft-cap or a scale)"
    # The verdict is cached per config, not per class: the same class without the soft-cap tiles.
    gemma.config.final_logit_softcapping = None
    assert loss_tiles(gemma).ok
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "validate", str(REPO / "configs" / "tiny.yaml"), "train.loss_tile=64",
         "model.name=hf:Gemma2ForCausalLM", "model.config={hidden_size: 32, intermediate_size: 64, "
         "num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, vocab_size: 256}"],
        capture_output=True, text=True, env={**os.environ, "ZOFF_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "zoff: error: train.loss_tile: Gemma2ForCausalLM cannot have its loss tiled: its logits are changed "
        "after the output head (a soft-cap or a scale); set train.loss_tile: 0"
    ], p.stderr
