"""grad_store.unit_norm: the host's per-unit gradient norm that clipping and the reported grad_norm use."""

from __future__ import annotations

import math

import pytest
import torch

from zoff.engine.step.grad_store import NORM_CHUNK, unit_norm


def _exact(g: torch.Tensor) -> float:
    return math.sqrt(float(g.double().pow(2).sum()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [0, 1, NORM_CHUNK - 1, NORM_CHUNK, 3 * NORM_CHUNK + 17])
def test_the_norm_is_the_fp64_norm_of_the_values(n: int, dtype: torch.dtype) -> None:
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    got = unit_norm(g)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert float(got) == pytest.approx(_exact(g), rel=1e-12, abs=0.0)


def test_a_large_shard_keeps_its_small_squares() -> None:
    # 16M bf16 values of ~3 whose squares sum past 1e8: an fp32 accumulator (torch's CPU vector_norm with
    # dtype=float32) drops much of each new square there; fp64 does not.
    g = (torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    assert float(unit_norm(g)) == pytest.approx(_exact(g), rel=1e-12, abs=0.0)


def test_a_shaped_shard_is_read_whole() -> None:
    g = torch.randn(3, NORM_CHUNK // 2 + 5, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert float(unit_norm(g)) == pytest.approx(_exact(g), rel=1e-12, abs=0.0)


@pytest.mark.parametrize(("bad", "want"), [(float("inf"), math.inf), (float("nan"), None)])
def test_non_finite_values_give_a_non_finite_norm(bad: float, want: float | None) -> None:
    # fp16's loss scaler skips the step on a non-finite norm (zero.py): the bad value must not vanish in a
    # later chunk's sum.
    g = torch.ones(2 * NORM_CHUNK + 3, dtype=torch.float16)
    g[NORM_CHUNK + 1] = bad
    got = float(unit_norm(g))
    assert math.isnan(got) if want is None else got == want


def test_huge_fp32_values_do_not_overflow() -> None:
    # 1e20 squared overflows fp32 but not fp64: a finite gradient keeps a finite norm
    g = torch.full((10,), 1e20)
    assert float(unit_norm(g)) == pytest.approx(float(g[0]) * math.sqrt(10), rel=1e-12)  # (fp32's 1e20)
