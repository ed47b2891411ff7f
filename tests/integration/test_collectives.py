"""gloo collectives over real ranks: the chunked reduce-scatter equals the dense one bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.harness import spawn
from zoff.engine.comm.collectives import Comm

# (shard length on 3 ranks, chunks as (start, length)): gaps, a chunk spanning every owner, chunks ending on a boundary,
# an empty chunk, and a layout with no chunk in some rank's slice.
LAYOUTS = [
    (7, [(0, 3), (3, 4), (9, 5), (16, 2)]),
    (5, [(1, 13)]),
    (4, [(0, 4), (4, 0), (4, 4)]),
    (6, [(13, 2)]),
]


def _chunked_vs_dense(rank: int, world: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    comm = Comm()
    out = []
    for i, (n, layout) in enumerate(LAYOUTS):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        n = n * 3 // world  # the same logical buffer (3 ranks' worth) at every world size
        chunks = [(s, torch.randn(k, generator=gen).to(dtype)) for s, k in layout]
        dense = torch.zeros(n * world, dtype=dtype)
        for s, t in chunks:
            dense[s : s + t.numel()] = t
        want = torch.full((n,), float("nan"), dtype=dtype)
        comm.reduce_scatter(dense, want)
        got = torch.full((n,), float("nan"), dtype=dtype)  # gaps must come out as zeros, not stale values
        comm.reduce_scatter_chunks(chunks, got)
        out.append((got, want))
    # Several chunked reductions in flight at once, interleaved with an all-gather: tags must not collide.
    gen = torch.Generator().manual_seed(rank)
    bufs = [torch.randn(4 * world, generator=gen).to(dtype) for _ in range(3)]
    handles, gots = [], []
    for b in bufs:
        gots.append(torch.empty(4, dtype=dtype))
        handles.append(comm.reduce_scatter_chunks([(0, b[:3]), (3, b[3:])], gots[-1], async_op=True))
    gathered = torch.empty(2 * world, dtype=dtype)
    handles.append(comm.all_gather(torch.full((2,), float(rank), dtype=dtype), gathered, async_op=True))
    for h in handles:
        h.wait()
    for b, got in zip(bufs, gots, strict=True):
        want = torch.empty(4, dtype=dtype)
        comm.reduce_scatter(b.clone(), want)
        out.append((got, want))
    out.append((gathered, torch.arange(world, dtype=dtype).repeat_interleave(2)))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_scatter_chunks_equals_dense(world: int, dtype: torch.dtype) -> None:
    for rank, pairs in enumerate(spawn(_chunked_vs_dense, world, dtype)):
        for i, (got, want) in enumerate(pairs):
            assert torch.equal(got, want), (rank, i, got, want)


def test_reduce_scatter_chunks_single_process() -> None:
    comm = Comm()
    got = torch.full((8,), float("nan"))
    comm.reduce_scatter_chunks([(1, torch.ones(2)), (5, torch.full((3,), 2.0))], got)
    assert got.tolist() == [0, 1, 1, 0, 0, 2, 2, 2]
    assert comm.stats.elements["reduce_scatter"] == 8
