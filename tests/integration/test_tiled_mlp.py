"""train.mlp_tile: each block's MLP computed a tile of tokens at a time, recomputed in backward: the losses,
gradients and weights of the untiled model (to the order of the weight gradients' sums over tokens), its
intermediates never saved (what the estimate counts, to the byte), for the builtin GPT and a transformers
Llama, and through the engine at stage 3 with offload."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.datafiles import chat_llama_files
from tests.harness import assert_close_losses, assert_close_params, run_zoff_many, tiny_cfg
from zoff.config import ModelConfig, config_from_dict
from zoff.engine.precision import DTYPES
from zoff.errors import UserError
from zoff.models import build_model, lm_loss
from zoff.models.gpt import GPT
from zoff.models.tiling import sequence_wise_parts, tile_mlps
from zoff.planning import activations as A
from zoff.trainer.session import build_session

pytestmark = pytest.mark.slow


def _grads(model, x, y) -> tuple[float, torch.Tensor]:
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt_tiled_mlp_saves_what_the_estimate_says_and_equals_untiled(precision: str) -> None:
    m = ModelConfig(name="gpt", n_layer=2, n_head=2, d_model=32, vocab_size=256, seq_len=16)
    torch.manual_seed(0)
    base = build_model(m).to(DTYPES[precision]).train()
    x, y = torch.randint(256, (2, 3, 16))
    tiled = copy.deepcopy(base)
    assert tile_mlps(tiled, 10) == 2  # 48 tokens: tiles of 10, the last of 8
    real = {}
    for ckpt in (True, False):
        base.activation_checkpointing = tiled.activation_checkpointing = ckpt
        real[ckpt] = A.saved_bytes(tiled, lambda: lm_loss(tiled(x), y))
        assert real[ckpt] == A.gpt_activations(m, 3, 16, precision, ckpt, "cpu", mlp_tile=10).saved
    plain_saved = A.saved_bytes(base, lambda: lm_loss(base(x), y))
    assert (
        plain_saved - real[False] == 2 * 48 * 8 * 32 * DTYPES[precision].itemsize
    )  # fc and GELU outputs, per layer
    if precision == "fp32":
        want, got = _grads(base, x, y), _grads(tiled, x, y)
        assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6 * want[1].abs().max().item())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return chat_llama_files(tmp_path_factory.mktemp("tiled-mlp"), 32)


def test_llama_mlps_are_tiled_and_the_probe_counts_it(llama) -> None:
    """transformers' LlamaMLP is found by name; gradients equal the untiled model's; the meta-device probe of
    the estimate, run with the same tiling, drops the MLP intermediates (4 x intermediate_size per token)."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(llama["llama"], dtype=torch.float32).train()
    tiled = copy.deepcopy(base)
    assert [n for n, _ in sequence_wise_parts(tiled)] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    tile_mlps(tiled, 16)
    x = torch.randint(100, (2, 32))
    want, got = _grads(base, x, x), _grads(tiled, x, x)
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6 * want[1].abs().max().item())
    m = config_from_dict(
        tiny_cfg(model={"name": "hf:LlamaForCausalLM", "path": llama["llama"], "seq_len": 32})
    ).model
    plain, probed = (A.probe_activations(m, 2, 32, "fp32", False, tile) for tile in (0, 16))
    # (the probe once failed on every transformers model, its activations counted 0: a mask check read a
    # meta tensor's value) now at or above what the real model saves: the materialised mask is counted
    real = A.saved_bytes(base, lambda: lm_loss(base(x), x))
    assert plain.method.startswith("measured") and real <= plain.saved <= 1.5 * real, (plain, real)
    assert plain.saved - probed.saved == 2 * 2 * 32 * 4 * 48 * 4  # layers x tokens x 4 x intermediate x fp32


@pytest.mark.parametrize(
    "zero", [{"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}],
    ids=["zero3-offload"],
)  # fmt: skip
def test_engine_runs_with_tiled_mlps_equal_untiled_on_two_ranks(zero: dict) -> None:
    zero = {**zero, "param_persistence_threshold": 64}
    train = {"max_steps": 4, "activation_checkpointing": True}
    cfgs = [tiny_cfg(zero=zero, train=train), tiny_cfg(zero=zero, train={**train, "mlp_tile": 12})]
    plain, tiled = run_zoff_many(cfgs, 2)
    assert_close_losses(tiled["losses"], plain["losses"], rtol=1e-6)
    assert_close_params(tiled["params"], plain["params"], rtol=1e-5)


def test_a_model_without_an_mlp_is_refused() -> None:
    cfg = config_from_dict(
        tiny_cfg(
            model={"name": "python:tests.fixtures_models:tied_frozen", "d_model": 48}, train={"mlp_tile": 8}
        )
    )
    with pytest.raises(UserError, match=r"train\.mlp_tile: \w+ has no MLP to tile"):
        build_session(cfg, torch.device("cpu"))


def test_gpt_without_grad_runs_untiled() -> None:
    torch.manual_seed(0)
    model = GPT(1, 2, 16, 256, 8)
    x = torch.randint(256, (2, 8))
    want = model(x)
    tile_mlps(model, 4)
    with torch.no_grad():
        assert torch.equal(model(x), want)
