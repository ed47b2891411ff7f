"""Rotary position embeddings for the builtin GPT (model.positions: rotary), as Llama's: each query and key head
dimension pair rotated by position x theta^(-2i/head_dim), the halves convention of transformers'
`rotate_half`. No parameter grows with the context (a learned table of 4M positions x 4096 is 16B parameters).

The tables are computed once per forward from the tokens' positions (under train.sequence_parallel, the
shard's positions in the whole sequence; packed examples restart at 0) and shared by every layer. The rotation
is an autograd function that keeps only the shared tables for backward, not a rotated copy per layer."""

from __future__ import annotations

import torch


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (rows or 1, 1, seq, head_dim) in `dtype`, from positions (seq) or (rows, seq); computed in
    fp32 and rounded once, as transformers does."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    angles = positions.reshape(-1, positions.shape[-1], 1).float() * inv_freq
    both = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return both.cos().to(dtype), both.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rotate_half_back(x: torch.Tensor) -> torch.Tensor:
    """The transpose of _rotate_half (what its backward applies)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((b, -a), dim=-1)


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return grad * cos + _rotate_half_back(grad * sin), None, None


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (batch, heads, seq, head_dim) rotated by its tokens' positions."""
    return _Rotate.apply(x, *tables)
