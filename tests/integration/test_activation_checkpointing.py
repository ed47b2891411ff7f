"""The builtin GPT with activation checkpointing trains exactly like plain PyTorch without it, at every stage;
at stage 3 the recompute in backward re-gathers each block and every gathered unit is released again."""

from __future__ import annotations

import pytest
import torch

from tests.harness import assert_close_losses, assert_close_params, reference_run, spawn, tiny_cfg
from zoff.config import config_from_dict
from zoff.trainer.loop import train_loop
from zoff.trainer.session import build_session

pytestmark = pytest.mark.slow
STAGES = [0, 1, 2, 3]
N_LAYER = 4


def _cfg(stage: int, checkpointing: bool = True) -> dict:
    return tiny_cfg(
        model={"n_layer": N_LAYER},
        train={"activation_checkpointing": checkpointing},
        zero={"stage": stage, "param_persistence_threshold": 64, "reduce_bucket_size": 3000},
    )


def _run(cfg_dict: dict) -> dict:
    """tests/harness.py zoff_rank, also recording block forwards and what stage 3 keeps gathered."""
    cfg = config_from_dict(cfg_dict)
    s = build_session(cfg, torch.device("cpu"))
    e, g = s.engine, s.engine.gatherer
    norms, after_step, at_backward_end = [], [], []
    forwards = [0] * N_LAYER

    def counter(i: int):
        def count(module, args):
            forwards[i] += torch.is_grad_enabled()  # training forwards and backward's recomputes

        return count

    for i, block in enumerate(e.model.blocks):
        block.register_forward_pre_hook(counter(i))
    if g is not None:
        release_all = g.release_all

        def release() -> None:  # backward ends with this: record what is still gathered then
            if g.in_backward:
                at_backward_end.append(g.gathered_bytes())
            release_all()

        g.release_all = release
    engine_step = e.step

    def step(lr: float):
        result = engine_step(lr)
        norms.append(result.grad_norm)
        if g is not None:
            after_step.append(g.gathered_bytes())
        return result

    e.step = step
    losses = train_loop(s)
    return {
        "losses": losses,
        "grad_norms": norms,
        "params": e.gathered_params(),
        "forwards": forwards,
        "after_step": after_step,
        "at_backward_end": at_backward_end,
        "gathered_at_end": g.gathered_bytes() if g else None,
        "root_bytes": sum(e.full[u].numel() * e.full[u].element_size() for u in g.root_units) if g else 0,
        "accum": s.batches.grad_accum,
    }


def _rank(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    return [_run(c) for c in cfgs]


@pytest.fixture(scope="module")
def runs() -> tuple[list[dict], dict]:
    # reference_run never checkpoints: the recompute must not change a single step.
    return spawn(_rank, 2, [_cfg(s) for s in STAGES])[0], reference_run(config_from_dict(_cfg(0, False)), 2)


@pytest.mark.parametrize("stage", STAGES)
def test_checkpointed_gpt_matches_reference(runs, stage: int) -> None:
    results, ref = runs
    got = results[stage]
    assert_close_losses(got["losses"], ref["losses"])
    assert_close_losses(got["grad_norms"], ref["grad_norms"])
    assert_close_params(got["params"], ref["params"])
    assert ref["losses"][-1] < ref["losses"][0]
    # Checkpointing was really on: each block ran forward twice per micro-batch (once more in backward).
    steps = len(ref["losses"])
    assert got["forwards"] == [2 * steps * got["accum"]] * N_LAYER


def test_stage3_checkpointing_releases_every_unit(runs) -> None:
    got = runs[0][3]
    steps = len(got["losses"])
    assert got["gathered_at_end"] == 0
    assert got["after_step"] == [0] * steps
    # Each block's unit goes once its gradients are in, recompute or not: when backward ends only the root
    # unit (embeddings, final norm, head), kept from forward to the end of backward, is still gathered.
    assert got["root_bytes"] > 0
    assert got["at_backward_end"] == [got["root_bytes"]] * (steps * got["accum"])
