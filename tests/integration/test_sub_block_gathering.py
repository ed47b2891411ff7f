"""Gathering below the block at stage 3: `zero.block_classes` naming parts of the layers (a layer too big to
gather twice is gathered part by part). Exact against plain PyTorch, with and without checkpointing and
parameter offload, and the gathered bytes follow the largest part, not the whole layer; the estimate's
working set shrinks the same way."""

from __future__ import annotations

import pytest

from tests.harness import assert_close_losses, assert_close_params, reference_run, run_zoff_many, tiny_cfg
from zoff.config import config_from_dict
from zoff.engine.partition import find_blocks, plan_partition
from zoff.models import build_model
from zoff.planning.memory import stage3_working_set

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
