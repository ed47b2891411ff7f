"""Packed rows attend example by example above a mask size (zoff/models/packed_attention.py): the same outputs
and gradients as through the (s x s) mask, and the plan each kind of row gets."""

from __future__ import annotations

import torch

from zoff.models.packed_attention import attend, attention_plan

# two rows of 12: three examples, then two (the second row starts mid-document: its first position is 5)
POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6]])


def test_the_plan_of_each_kind_of_row():
    plain = torch.arange(12).expand(2, 12)
    assert attention_plan(plain, None) is None
    mask = attention_plan(POSITIONS, None)
    assert mask.shape == (2, 1, 12, 12) and mask.dtype == torch.bool
    assert attention_plan(POSITIONS, None, limit=2 * 12 * 12 - 1) == (
        ((0, 4), (4, 7), (7, 12)),
        ((0, 5), (5, 12)),
    )
    windowed = attention_plan(plain, 3, limit=0)  # a window keeps the mask, whatever its size
    assert windowed.shape == (2, 1, 12, 12) and not windowed[0, 0, 5, 2] and windowed[0, 0, 5, 3]


def test_example_by_example_equals_the_mask_forward_and_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 3, 12, 8, dtype=torch.float64)
    got, want = {}, {}
    for out, plan in (
        (want, attention_plan(POSITIONS, None)),
        (got, attention_plan(POSITIONS, None, limit=0)),
    ):
        y = attend(q, k, v, plan, 0.0, 0.3)
        out["y"] = y.detach()
        out["grads"] = torch.autograd.grad(y, (q, k, v), g)
    assert isinstance(attention_plan(POSITIONS, None, limit=0), tuple)
    assert torch.allclose(got["y"], want["y"], atol=1e-12)
    for a, b in zip(got["grads"], want["grads"], strict=True):
        assert torch.allclose(a, b, atol=1e-12)
