"""Ulysses sequence parallelism (train.sequence_parallel N): a group of N ranks trains the same sequences, each
rank holding 1/N of their tokens, and attention is the one place where tokens meet.

Around attention, one all-to-all turns this rank's queries, keys and values (its s/N tokens, every head) into
every token of 1/N of the heads; attention runs over the whole sequence for those heads; a second all-to-all
turns the output back into the rank's own tokens, every head. Everything else a layer does is per token and
runs on the rank's shard alone. The exchanges are autograd functions whose backward is the other exchange, so
gradients of a token's loss reach the ranks holding the tokens it attended to; the engine's reduction over the
world then sums what every rank computed, and each rank's loss is its tokens' share of the global batch's
(data/corpus.py): the gradient is the one-rank gradient of the same batch.

Masks come from positions, never from a local length: each layer gathers the group's position ids (the
sequence's, in order) and attends causally within each packed example (and within a sliding window where a
model has one). Heads divide by N; key/value heads under GQA divide by N, or N divides them and each is
replicated N / K times before the exchange (each rank then receives the one its query heads share).

Costs, per layer and pass (backward repeats them in reverse): one exchange of (q + k + v) and one of the output,
each sending (N - 1) / N of a rank's s/N x width elements; one all-gather of s int64 positions."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zoff.errors import UserError
from zoff.models.packed_attention import Plan, attend, attention_plan

KEY = "train.sequence_parallel"


@dataclass
class ExchangeStats:
    """What the exchanges cost this rank so far (the benchmark reads it): host seconds inside the collectives,
    elements sent and calls."""

    seconds: float = 0.0
    elements: int = 0
    calls: int = 0
    attended: set[int] = field(default_factory=set)  # this forward's layers that went through the exchange


@dataclass
class ForwardMemo:
    """One forward's whole-sequence positions and mask, built at its first layer and shared by the rest (and by
    their recomputes): one all-gather and one host check a forward, and one mask tensor that every layer's
    backward keeps, not one a layer. Keyed by the positions tensor itself (the model hands every layer the
    same one); cleared as each forward starts."""

    positions: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)  # window -> attention_plan (a mask, examples, or None)
    whole: torch.Tensor | None = None


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's place among the ranks that share its sequences: ranks [g*N, (g+1)*N) form group g, and this
    rank holds shard `index` of each sequence. N == 1: no group, nothing exchanged."""

    size: int
    index: int
    group: dist.ProcessGroup | None = None
    stats: ExchangeStats = field(default_factory=ExchangeStats, compare=False)
    memo: ForwardMemo = field(default_factory=ForwardMemo, compare=False)


def sequence_group(n: int, timeout_s: float | None = None) -> SequenceGroup:
    """This rank's group of `n` (torch.distributed initialised when n > 1). Every rank creates every group, in
    the same order, as torch requires of new_group."""
    if n == 1:
        return SequenceGroup(1, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    mine = None
    for first in range(0, world, n):
        g = dist.new_group(list(range(first, first + n)), **timeout)
        if first <= rank < first + n:
            mine = g
    return SequenceGroup(n, rank % n, mine)


# ------------------------------------------------------------------------------------------ the exchanges


def _all_to_all(send: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """Chunk j of `send` (its first dimension) goes to rank j of the group; chunk i of the result came from i."""
    recv = torch.empty_like(send)
    t0 = time.perf_counter()
    dist.all_to_all_single(recv, send, group=sg.group)
    sg.stats.seconds += time.perf_counter() - t0
    sg.stats.elements += send.numel() * (sg.size - 1) // sg.size
    sg.stats.calls += 1
    return recv


def _spans(parts: list[int]) -> list[tuple[int, int]]:
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return list(zip(starts, parts, strict=True))


def _to_heads(xs: list[torch.Tensor], sg: SequenceGroup) -> list[torch.Tensor]:
    """Each (b, h, s/N, d) of this rank's tokens, every head -> (b, h/N, s, d), every token of this rank's heads;
    one all-to-all for all of them. Rank j's chunk of the send buffer holds its heads of each tensor in turn,
    written there directly (one copy), and the buffer is freed before the received one is laid out."""
    n, (b, _, sl, d) = sg.size, xs[0].shape
    parts = [x.shape[1] // n for x in xs]
    send = xs[0].new_empty(n, b, sum(parts), sl, d)
    for x, (a, h) in zip(xs, _spans(parts), strict=True):
        send[:, :, a : a + h].copy_(x.reshape(b, n, h, sl, d).transpose(0, 1))
    recv = _all_to_all(send, sg)
    del send
    return [recv[:, :, a : a + h].permute(1, 2, 0, 3, 4).reshape(b, h, n * sl, d) for a, h in _spans(parts)]


def _to_tokens(ys: list[torch.Tensor], sg: SequenceGroup) -> list[torch.Tensor]:
    """The inverse of _to_heads: each (b, h/N, s, d) -> (b, h, s/N, d)."""
    n, (b, _, s, d) = sg.size, ys[0].shape
    parts = [y.shape[1] for y in ys]
    send = ys[0].new_empty(n, b, sum(parts), s // n, d)
    for y, (a, h) in zip(ys, _spans(parts), strict=True):
        send[:, :, a : a + h].copy_(y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4))
    recv = _all_to_all(send, sg)
    del send
    return [recv[:, :, a : a + h].transpose(0, 1).reshape(b, n * h, s // n, d) for a, h in _spans(parts)]


class _ToHeads(torch.autograd.Function):
    """_to_heads, whose backward is _to_tokens of the gradients."""

    @staticmethod
    def forward(ctx, sg: SequenceGroup, *xs: torch.Tensor):
        ctx.sg = sg
        return tuple(_to_heads(list(xs), sg))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return None, *_to_tokens(list(grads), ctx.sg)


class _ToTokens(torch.autograd.Function):
    """_to_tokens, whose backward is _to_heads of the gradients."""

    @staticmethod
    def forward(ctx, sg: SequenceGroup, *ys: torch.Tensor):
        ctx.sg = sg
        return tuple(_to_tokens(list(ys), sg))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return None, *_to_heads(list(grads), ctx.sg)


def _exchange_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sg: SequenceGroup):
    """q, k, v of this rank's tokens -> of this rank's heads, in one all-to-all where their head sizes agree."""
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return tuple(_ToHeads.apply(sg, t)[0] for t in (q, k, v))
    return _ToHeads.apply(sg, q, k, v)


def _gather_positions(position_ids: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """The whole sequence's position ids (rows, s), from every rank's (rows, s/N)."""
    parts = [torch.empty_like(position_ids) for _ in range(sg.size)]
    dist.all_gather(parts, position_ids.contiguous(), group=sg.group)
    return torch.cat(parts, dim=-1)


def _forward_plan(position_ids: torch.Tensor, sg: SequenceGroup, window: int | None) -> Plan:
    """attention_plan of the group's whole positions, once per forward and window (ForwardMemo)."""
    memo = sg.memo
    if memo.positions is not position_ids:
        memo.positions, memo.masks = position_ids, {}
        memo.whole = _gather_positions(position_ids, sg)
    if window not in memo.masks:
        memo.masks[window] = attention_plan(memo.whole, window)
    return memo.masks[window]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor,
    sg: SequenceGroup,
    dropout: float = 0.0,
    scale: float | None = None,
    window: int | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence. q (b, H, s/N, d), k and v (b, K, s/N, d),
    position_ids (b or 1, s/N) of this rank's tokens in the whole sequence -> (b, H, s/N, d). `layer`: the
    calling module's id, for the per-forward check that every layer went through the exchange."""
    n, kv = sg.size, k.shape[1]
    if kv % n:  # fewer key/value heads than ranks (N % K == 0 is checked): each rank gets the one it needs
        k, v = (t.repeat_interleave(n // kv, dim=1) for t in (k, v))
    q, k, v = _exchange_qkv(q, k, v, sg)
    if k.shape[1] != q.shape[1]:  # GQA: the local query heads share the local key/value heads, in order
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    y = attend(q, k, v, _forward_plan(position_ids, sg, window), dropout, scale)
    sg.stats.attended.add(layer)
    return _ToTokens.apply(sg, y)[0]


# ------------------------------------------------------------------------------- fitting it into a model


def eager_attention() -> Callable[..., torch.Tensor]:
    """ulysses_attention as a split model calls it: under train.compile it runs eager (collectives, host timing)
    between the compiled regions around it. Made when a model is split, not at import: torch.compiler.disable
    imports torch._dynamo, ~2 s of CPU that every rank of every run would otherwise pay."""
    return torch.compiler.disable(ulysses_attention)


def check_heads(heads: int, kv_heads: int, n: int, where: str) -> None:
    """One line naming the key where the heads cannot be split over `n` ranks."""
    if heads % n:
        raise UserError(f"{KEY}: {n} does not divide {where}'s {heads} attention heads")
    if kv_heads % n and n % kv_heads:
        raise UserError(
            f"{KEY}: {where}'s {kv_heads} key/value heads neither divide by {n} nor divide it (each rank needs "
            "whole key/value heads: N divides them, or they are replicated N / K times)"
        )
