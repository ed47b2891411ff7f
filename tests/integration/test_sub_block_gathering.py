"""Gathering below the block at stage 3: `zero.block_classes` naming parts of the layers (a layer too big to
gather twice is gathered part by part). Exact against plain PyTorch, with and without checkpointing and
parameter offload, and the gathered bytes follow the largest part, not the whole layer; the estimate's
working set shrinks the same way. What the estimate picks for a 405B layer (memory.stage3_fallbacks: each
Linear its own gather, one reduction in flight) trains exactly too, under the MLP and loss tiles and for a
transformers Llama."""

from __future__ import annotations

import pytest

from tests.harness import (
    TINY_LLAMA,
    assert_close_losses,
    assert_close_params,
    reference_run,
    run_zoff_many,
    tiny_cfg,
)
from zoff.config import config_from_dict
from zoff.engine.partition import find_blocks, plan_partition
from zoff.models import build_model, meta_model
from zoff.planning.memory import stage3_fallbacks, stage3_working_set

pytestmark = pytest.mark.slow
PARTS = ["CausalSelfAttention", "MLP"]


def _cfg(parts: bool, ckpt: bool, offload: bool) -> dict:
    zero = {"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": 1}
    if parts:
        zero["block_classes"] = PARTS
    if offload:
        zero |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    return tiny_cfg(
        model={"n_layer": 3, "d_model": 64, "n_head": 2}, zero=zero,
        train={"max_steps": 4, "activation_checkpointing": ckpt},
    )  # fmt: skip


def test_parts_named_in_block_classes_become_the_blocks() -> None:
    m = build_model(config_from_dict(_cfg(True, False, False)).model)
    assert find_blocks(m, tuple(PARTS)) == [f"blocks.{i}.{p}" for i in range(3) for p in ("attn", "mlp")]
    assert find_blocks(m, ()) == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize(
    "ckpt, offload",
    [pytest.param(False, False, marks=pytest.mark.grid), (True, True)],
    ids=["plain", "ckpt-param-offload"],
)
def test_part_by_part_gathering_equals_plain_pytorch_and_gathers_less(ckpt: bool, offload: bool) -> None:
    whole, parts = run_zoff_many([_cfg(False, ckpt, offload), _cfg(True, ckpt, offload)], 2)
    ref = reference_run(config_from_dict(_cfg(True, ckpt, offload)), 2)
    assert_close_losses(parts["losses"], ref["losses"])
    assert_close_params(parts["params"], ref["params"])
    assert parts["memory"]["buffers"] < whole["memory"]["buffers"]
    cfg = config_from_dict(_cfg(True, ckpt, offload))
    plan = lambda classes: plan_partition(  # noqa: E731
        build_model(cfg.model), 2, 10**9, per_block=True, block_classes=classes
    )
    by_parts = stage3_working_set(plan(tuple(PARTS)), cfg.zero)
    by_layers = stage3_working_set(plan(()), cfg.zero)
    assert by_parts < by_layers


LLAMA = TINY_LLAMA


def test_the_estimates_fallbacks_are_the_layers_parts_then_each_linear() -> None:
    gpt = meta_model(config_from_dict(_cfg(True, False, False)).model)
    assert stage3_fallbacks(gpt) == [
        {"block_classes": ("CausalSelfAttention", "MLP")},
        {"block_classes": ("Linear",)},
        {"block_classes": ("Linear",), "overlap_comm": False},
    ]
    pytest.importorskip("transformers")
    llama = meta_model(config_from_dict(tiny_cfg(model=LLAMA)).model)
    assert [f["block_classes"] for f in stage3_fallbacks(llama)][:2] == [
        ("LlamaAttention", "LlamaMLP"),
        ("Linear",),
    ]
    blocks = find_blocks(llama, ("Linear",))
    assert len(blocks) == 2 * 7 and all(".layers." in b for b in blocks)  # q k v o gate up down; not lm_head


def test_each_linear_gathered_alone_with_tiles_equals_plain_pytorch() -> None:
    """The finest fallback, [Linear] with one reduction in flight, with checkpointing, parameter offload and
    the MLP and loss tiles (the head stays in the root, where the tiled loss reads it), at world 2 with
    accumulation; and a transformers Llama with its layers gathered part by part."""
    pytest.importorskip("transformers")
    gpt = _cfg(False, True, True)
    gpt["zero"] |= {"block_classes": ["Linear"], "overlap_comm": False}
    gpt["train"] |= {"mlp_tile": 8, "loss_tile": 7}
    llama = tiny_cfg(
        model=LLAMA, zero={"stage": 3, "param_persistence_threshold": 0, "block_classes": ["LlamaAttention", "LlamaMLP"]},
        train={"max_steps": 4, "activation_checkpointing": True},
    )  # fmt: skip
    got = run_zoff_many([gpt, llama], 2)
    for cfg, run in zip([gpt, llama], got, strict=True):
        plain = {
            **cfg,
            "zero": {"stage": 0},
            "train": {k: v for k, v in cfg["train"].items() if "tile" not in k},
        }
        ref = reference_run(config_from_dict(plain), 2)
        assert_close_losses(run["losses"], ref["losses"])
        assert_close_params(run["params"], ref["params"])
