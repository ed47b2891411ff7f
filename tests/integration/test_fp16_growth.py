"""fp16 dynamic loss scaling grows the scale only after the step has unscaled with the one its gradients carry.

A step's gradients were computed at scale S; if the scale doubled before the unscale, they would be divided by
2S: half the gradient (Adam mostly hides that, the global grad norm and clipping do not).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.harness import spawn, tiny_cfg
from zoff.config import config_from_dict
from zoff.engine.precision import LossScaler
from zoff.models import lm_loss
from zoff.trainer.loop import train_loop
from zoff.trainer.session import build_session

STAGES = [0, 1, 2, 3]
STEPS = 4
# The tiny GPT's largest gradient element is ~0.28 unscaled: ~36k of fp16's 65504 at 2^17 (the two ranks' sum,
# taken before the average, stayed finite in every measured run) and an overflow at 2^18. Below ~2^14,
# intermediate activation gradients fall into fp16's subnormal range, where rounding is not scale-invariant.
# Growing every step from 2^14 keeps STEPS = 4 steps (2^14 ... 2^17) inside that window.
INIT_SCALE = 2.0**14
# Power-of-two scaling is exact for normal fp16 numbers, but a few intermediate gradients are still subnormal at
# the smaller scale (measured: 3-14 parameter-gradient elements per step differ, some by ~1e-3 relative), and
# Adam turns such a difference on a near-zero gradient into a visible update difference. Measured over these 4
# steps on 2 ranks, stages 0-3: grad norms within 1.0e-6 relative, losses within 9e-8, params within
# 3.3e-4 absolute. A scale grown before the unscale halves the grad norm (relative gap 0.5).
NORM_RTOL = 1e-5
LOSS_RTOL = 1e-6
PARAM_ATOL = 1e-3


def _run(cfg_dict: dict, growth_interval: int) -> dict:
    """One rank of a zoff run like tests/harness.py zoff_rank, with the scaler's growth interval set."""
    cfg = config_from_dict(cfg_dict)
    s = build_session(cfg, torch.device("cpu"))
    scaler = s.engine.scaler
    scaler.scale, scaler.growth_interval = INIT_SCALE, growth_interval
    norms, scales, stepped = [], [], []
    engine_step = s.engine.step

    def step(lr: float):
        scales.append(scaler.scale)  # the scale this step's gradients were computed with
        result = engine_step(lr)
        norms.append(result.grad_norm)
        stepped.append(result.stepped)
        return result

    s.engine.step = step
    losses = train_loop(s)
    return {
        "losses": losses,
        "grad_norms": norms,
        "scales": scales,
        "stepped": stepped,
        "final_scale": scaler.scale,
        "skipped": scaler.skipped,
        "params": s.engine.gathered_params(),
    }


def _growth_rank(rank: int, world: int, cfgs: list[dict]) -> list[tuple[dict, dict]]:
    return [(_run(c, growth_interval=1), _run(c, growth_interval=10**9)) for c in cfgs]


def _cfg(stage: int) -> dict:
    return tiny_cfg(
        train={"precision": "fp16", "grad_clip": 0, "max_steps": STEPS},
        zero={"stage": stage, "param_persistence_threshold": 64},
    )


@pytest.fixture(scope="module")
def growth_runs() -> dict[int, tuple[dict, dict]]:
    return dict(zip(STAGES, spawn(_growth_rank, 2, [_cfg(s) for s in STAGES])[0]))


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_growing_scale_gives_the_same_training(growth_runs, stage: int) -> None:
    grown, fixed = growth_runs[stage]
    # The scale really doubled after every step, none overflowed; the other run kept its scale.
    assert grown["scales"] == [INIT_SCALE * 2**k for k in range(STEPS)]
    assert grown["final_scale"] == INIT_SCALE * 2**STEPS
    assert fixed["scales"] == [INIT_SCALE] * STEPS and fixed["final_scale"] == INIT_SCALE
    for run in (grown, fixed):
        assert all(run["stepped"]) and run["skipped"] == 0
    for step, (a, b) in enumerate(zip(grown["grad_norms"], fixed["grad_norms"]), start=1):
        assert abs(a - b) <= NORM_RTOL * b, f"step {step}: grad norm {a!r} with growth vs {b!r} without"
    for step, (a, b) in enumerate(zip(grown["losses"], fixed["losses"]), start=1):
        assert abs(a - b) <= LOSS_RTOL * b, f"step {step}: loss {a!r} with growth vs {b!r} without"
    for name, p in fixed["params"].items():
        err = (grown["params"][name] - p).abs().max().item()
        assert err <= PARAM_ATOL, f"{name}: max abs diff {err}"


def test_loss_scaler_update() -> None:
    s = LossScaler(enabled=True, init_scale=2.0**10, growth_interval=3)
    for want in [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**12]:  # doubles on every 3rd clean step
        s.update(overflow=False)
        assert s.scale == want
    s.update(overflow=True)  # halves, skips, and restarts the count of clean steps
    assert (s.scale, s.clean_steps, s.skipped) == (2.0**11, 0, 1)
    s.update(overflow=False)
    s.update(overflow=False)
    assert s.scale == 2.0**11
    s.update(overflow=False)
    assert s.scale == 2.0**12
    tiny = LossScaler(enabled=True, init_scale=1.0)
    tiny.update(overflow=True)
    assert tiny.scale == 1.0  # never below 1
    off = LossScaler(enabled=False)
    off.update(overflow=True)
    assert (off.scale, off.skipped) == (1.0, 0)  # bf16/fp32: scale 1, never skips
    restored = LossScaler(enabled=True)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs a single-process run")
@pytest.mark.parametrize("stage", [0, 3])
def test_step_unscales_with_the_scale_of_its_gradients(stage: int) -> None:
    """One rank in this process: the optimizer receives exactly the gradients / S they were computed at, the
    reported norm is theirs, and only then does the scale double."""
    cfg = config_from_dict(
        tiny_cfg(train={"precision": "fp16", "grad_clip": 0, "grad_accum": 1}, zero={"stage": stage})
    )
    s = build_session(cfg, torch.device("cpu"))
    e = s.engine
    e.scaler.scale, e.scaler.growth_interval = INIT_SCALE, 1
    received = []
    optimizer_step = e.optimizer.step

    def capture(grads, lr, **kwargs):
        received.extend(g.clone() for g in grads)
        return optimizer_step(grads, lr, **kwargs)

    e.optimizer.step = capture
    for step in range(3):
        scale = e.scaler.scale
        e.zero_grad()
        x, y = s.batches.micro_batch_at(step, 0)
        e.backward(lm_loss(e.model(x), y), sync=True)
        scaled = [g.clone() for g in e.gshard]  # fp16, scaled by `scale`
        assert all(g.dtype == torch.float16 for g in scaled)
        received.clear()
        result = e.step(1e-3)
        assert result.stepped
        want = [g.float() * (1.0 / scale) for g in scaled]  # a power of two: exact
        assert len(received) == len(want)
        for got, w in zip(received, want):
            assert torch.equal(got, w), f"step {step + 1}: gradients unscaled by {scale} expected"
        # the engine's norms are fp64 sums (grad_store.unit_norm): the exact norm of these fp16 values
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(g.double())) ** 2 for g in scaled))
        assert result.grad_norm == pytest.approx(norm / scale, rel=1e-12)
        assert e.scaler.scale == 2 * scale and e.scaler.clean_steps == step + 1
