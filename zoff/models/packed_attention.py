"""Causal attention over whole sequences whose rows may pack several examples, without an (s x s) mask where
one would be large.

A packed row attends within each example only. The usual way is a boolean (rows, 1, s, s) mask, which is
16 GiB a row at 128K tokens, whatever the ranks sharing the sequence: long packed sequences would stop far
short of what plain ones reach. Above MASK_LIMIT bytes, each example (a run of positions counting up by one)
attends alone through causal SDPA instead: no mask, and each example's scores as the masked kernel's (the
same arithmetic but for the masked-out terms, which contribute exact zeros). Costs one SDPA call per example
and row, and one copy of the output (the examples' outputs joined): a row of many short examples is slower
this way, which is why short sequences keep the mask. A sliding window keeps the mask (not built otherwise)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoff.models.gpt import example_mask

MASK_LIMIT = 64 << 20  # bytes of boolean mask above which packed rows attend example by example

Segments = tuple[tuple[tuple[int, int], ...], ...]  # per row, each example's [start, end) positions
Plan = torch.Tensor | Segments | None  # a mask; the examples of each row; None: plain causal attention


def attention_plan(positions: torch.Tensor, window: int | None, limit: int = MASK_LIMIT) -> Plan:
    """How rows with these whole-sequence positions (rows, s) attend: None where plain causal attention is right
    (one example per row, no window), the examples of each row where a mask would pass `limit` bytes, else a
    (rows, 1, s, s) boolean mask."""
    rows, s = positions.shape
    plain = torch.equal(positions, torch.arange(s, device=positions.device).expand_as(positions))
    if plain and window is None:
        return None
    if window is None and rows * s * s > limit:
        return _segments(positions)
    mask = example_mask(positions)
    if window is not None:  # transformers' sliding window: query i sees keys j with i - j < window
        idx = torch.arange(s, device=positions.device)
        mask = mask & ((idx.view(-1, 1) - idx.view(1, -1)) < window)
    return mask


def _segments(positions: torch.Tensor) -> Segments:
    """Each row's examples: a new one wherever a position does not follow the previous (example_mask's rule)."""
    starts = torch.diff(positions, dim=-1, prepend=positions[:, :1]) != 1
    starts[:, 0] = True  # every row opens an example
    out = []
    for row in starts.cpu():
        at = row.nonzero().flatten().tolist() + [row.numel()]
        out.append(tuple(zip(at[:-1], at[1:], strict=True)))
    return tuple(out)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, dropout: float, scale: float | None
) -> torch.Tensor:
    """SDPA of (b, h, s, d) q, k, v under `plan` (attention_plan's)."""
    if not isinstance(plan, tuple):
        mask = plan
        if mask is not None and mask.shape[0] != q.shape[0]:
            mask = mask.expand(q.shape[0], *mask.shape[1:])
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scale
        )
    rows = []
    for r in range(q.shape[0]):
        segments = plan[r if len(plan) > 1 else 0]
        one = [t[r : r + 1] for t in (q, k, v)]
        parts = [
            F.scaled_dot_product_attention(
                *(t[:, :, a:b] for t in one), is_causal=True, dropout_p=dropout, scale=scale
            )
            for a, b in segments
        ]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)
