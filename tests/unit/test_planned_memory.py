"""The engine's allocated model states equal the policy table's prediction, and `zoff estimate` predicts with
that very function (engine/footprint.model_states): the estimate cannot drift from the engine unnoticed."""

from __future__ import annotations

import itertools

import pytest
import torch

import zoff.engine.report as zero_mod
from zoff.config import OffloadOptimizerConfig, OffloadParamConfig, OptimConfig, ZeroConfig
from zoff.engine import build_engine
from zoff.engine import footprint as policy_mod
from zoff.engine.policy import POLICIES, Policy
from zoff.models.gpt import GPT
from zoff.planning import memory

KEYS = ("params", "grads", "optimizer_states", "cpu_params", "cpu_grads", "cpu_optimizer_states")
CASES = [
    (pol, precision, accum, clip, delay)
    for pol in POLICIES
    if not pol.activation_checkpointing and pol.offload_optimizer != "nvme"  # nvme: its own test below
    for precision, accum, clip, delay in itertools.product(
        ("fp32", "bf16"), (1, 2), (0.0, 1.0), (False, True)
    )
    if not delay or pol.offload_optimizer == "cpu"
]


def _engine(pol, precision: str, accum: int, clip: float, delay: bool, swap: str | None = None):
    torch.manual_seed(0)
    model = GPT(2, 2, 32, 64, 16)
    model.blocks[0].ln1.weight.requires_grad_(False)  # a frozen parameter too
    zero = ZeroConfig(
        stage=pol.stage,
        offload_optimizer=OffloadOptimizerConfig(
            device=pol.offload_optimizer,
            delay_update=delay,
            nvme_path=swap,  # grad_device auto: on disk (two files under delay_update)
            host_budget="min",  # the states on disk (the budget's split: tests/integration/test_host_budget.py)
        ),
        offload_param=OffloadParamConfig(device=pol.offload_param),
        param_persistence_threshold=64,
    )
    return build_engine(model, zero, OptimConfig(), precision=precision, grad_clip=clip, grad_accum=accum)


@pytest.mark.parametrize(("pol", "precision", "accum", "clip", "delay"), CASES, ids=str)
def test_allocated_model_states_equal_the_policy_tables(pol, precision, accum, clip, delay) -> None:
    eng = _engine(pol, precision, accum, clip, delay)
    mem, planned = eng.memory_report(), eng.planned_memory()
    got = {k: mem[k] for k in KEYS} | {"params": mem["params"] + mem["frozen_params"]}
    assert got == {k: planned[k] for k in KEYS}


def test_estimate_and_engine_share_one_function(monkeypatch) -> None:
    assert memory.model_states is policy_mod.model_states
    calls = []
    real = zero_mod.model_states
    monkeypatch.setattr(zero_mod, "model_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    _engine(POLICIES[2], "bf16", 2, 1.0, False).planned_memory()
    assert calls == [1]


DISK_POLICIES = [Policy(1, "nvme"), Policy(2, "nvme"), Policy(3, "nvme"), Policy(3, "nvme", "nvme")]


@pytest.mark.parametrize("pol", DISK_POLICIES, ids=str)
@pytest.mark.parametrize(("precision", "delay"), [("fp32", False), ("bf16", False), ("bf16", True)])
def test_the_disk_tier_allocates_what_the_table_plans(pol, precision: str, delay: bool, tmp_path) -> None:
    eng = _engine(pol, precision, 2, 1.0, delay, str(tmp_path))
    mem, planned = eng.memory_report(), eng.planned_memory()
    keys = (*KEYS, "disk_optimizer_states", "disk_params", "disk_grads")
    got = {k: mem[k] for k in keys} | {"params": mem["params"] + mem["frozen_params"]}
    assert got == {k: planned[k] for k in keys}
    # (DPU with the parameters in memory: the file its delayed step writes the new shards to)
    assert (planned["disk_params"] > 0) == (pol.offload_param == "nvme" or delay)
    assert planned["disk_optimizer_states"] > 0 and planned["optimizer_states"] == 0
    assert (
        planned["disk_grads"] > 0
    )  # (DPU: two files, the delayed step reads one while backward writes the other)
    eng.close()


def test_pinned_host_bytes_count_stage_3s_frozen_shards_too() -> None:
    """Under parameter offload to CPU the engine pins every sharded unit's shard, frozen ones included (a LoRA
    base is most of the model): the prediction counts them as ZeroEngine.pinned_bytes() does on a GPU."""
    from zoff.engine.footprint import pinned_host_bytes
    from zoff.engine.policy import engine_plan

    model = GPT(2, 2, 32, 64, 16)
    for p in model.blocks.parameters():
        p.requires_grad_(False)  # the blocks frozen, as a LoRA base's would be
    zero = ZeroConfig(
        stage=3,
        param_persistence_threshold=0,
        offload_optimizer=OffloadOptimizerConfig(device="cpu", pin_memory=False),
        offload_param=OffloadParamConfig(device="cpu"),
    )
    plan = engine_plan(model, 3, 2, zero)
    assert plan.frozen_units, "the frozen blocks are units of their own"
    shards = sum(u.shard for u in plan.all_units if not u.persistent)
    assert pinned_host_bytes(plan, Policy(3, "cpu", "cpu"), zero, "bf16", "cuda") == 2 * shards
    assert (
        pinned_host_bytes(plan, Policy(3, "cpu", "cpu"), zero, "bf16", "cpu") == 0
    )  # nothing pins on a CPU host
