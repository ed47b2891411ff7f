"""The disk tier's placement arithmetic that the estimate runs per row (engine/disk/placement.py): its fast
forms (counted, cached, sliced) equal the walk they summarise, piece by piece."""

from __future__ import annotations

import random
from types import SimpleNamespace

from zoff.engine.disk.placement import piece_bytes, piece_spans, spread_units, unit_pieces, walk_pieces


def _plan(shards: list[int]) -> SimpleNamespace:
    return SimpleNamespace(units=[SimpleNamespace(shard=n) for n in shards])


def test_unit_pieces_are_the_walks_pieces_of_each_unit_in_order() -> None:
    rng = random.Random(7)
    for subgroup in (None, 4096, 10_000, 1 << 20):  # (a few thousand pieces at most)
        shards = [0, 1, 4095, 4096, 4097, 1 << 20] + [rng.randrange(0, 1 << 20) for _ in range(40)]
        walk = walk_pieces(shards, subgroup)
        pieces = unit_pieces(_plan(shards), subgroup)
        assert [len(r) for r in pieces] == [len(piece_spans(n, subgroup)) for n in shards], subgroup
        assert [walk[k][0] for r in pieces for k in r] == [u for u, _, _ in walk]  # every piece, in order
        assert len(piece_bytes(_plan(shards), subgroup)) == len(walk)


def test_spread_units_sums_a_units_pieces_as_the_walk_lists_them() -> None:
    ram = [5, 1, 1, 7, 2, 2, 2, 9]
    units = [range(0, 1), range(1, 3), range(3, 4), range(4, 7), range(7, 8)]
    kept = spread_units(ram, units, 14)
    # unit 0 (5 of 5 seen) is over its share; units 1 and 2 fit theirs; 3 and 4 would pass the room
    assert kept == (1, 2, 3)
    assert sum(ram[k] for k in kept) <= 14
