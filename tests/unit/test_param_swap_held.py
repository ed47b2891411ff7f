"""The overlapped step's held write-backs (param_swap.SwappedShards, hold_units): a unit whose pieces were
all written back reads from them, bit for bit what the disk holds; a unit written in part, or evicted by
later units, reads from the disk; trim() and drop_held() hand the buffers back."""

from __future__ import annotations

from pathlib import Path

import torch

from zoff.engine.disk.param_swap import SwappedShards

PAGE = 4096  # a write starts on a page: pieces of whole 4096-element runs


def _shards(tmp_path: Path, hold: int) -> SwappedShards:
    return SwappedShards(
        {0: 3 * PAGE, 1: 2 * PAGE + 100, 2: PAGE}, torch.bfloat16, tmp_path, threads=2, request_bytes=1 << 20,
        hold_units=hold,
    )  # fmt: skip


def _write_unit(sw: SwappedShards, u: int, gen: torch.Generator) -> torch.Tensor:
    n = sw.numels[u]
    full = torch.randn(n, generator=gen)
    for lo in range(0, n, PAGE):  # piece by piece, as the walk writes them
        sw.write(u, lo, full[lo : lo + PAGE])
    return full.to(torch.bfloat16)


def test_a_whole_unit_reads_from_its_held_pieces_and_equals_the_disk(tmp_path: Path) -> None:
    sw = _shards(tmp_path, hold=2)
    gen = torch.Generator().manual_seed(0)
    want = _write_unit(sw, 1, gen)
    got = sw.read(1)
    assert not got.futures  # no disk read issued
    assert torch.equal(got.wait(), want)
    assert sw.read_from_memory_bytes == want.numel() * 2
    got.release()
    assert not sw.held and not sw._held_bufs and not sw._landed_bufs
    assert torch.equal(sw.load(1), want)  # the disk has the same bits (the write landed)
    assert sw.read_from_memory_bytes == want.numel() * 2
    sw.close()


def test_a_partly_written_or_evicted_unit_reads_from_the_disk(tmp_path: Path) -> None:
    sw = _shards(tmp_path, hold=2)
    gen = torch.Generator().manual_seed(1)
    before = _write_unit(sw, 0, gen)
    sw.flush()
    sw.drop_held()
    part = torch.randn(PAGE, generator=gen)
    sw.write(0, PAGE, part)  # only the middle page changed this step
    want = before.clone()
    want[PAGE : 2 * PAGE] = part.to(torch.bfloat16)
    assert torch.equal(sw.load(0), want)  # not covered by what is held: the disk, after the write landed
    assert sw.read_from_memory_bytes == 0
    # three units written while two are held: the first is evicted and comes from the disk
    ws = [_write_unit(sw, u, gen) for u in (0, 1, 2)]
    assert list(sw.held) == [1, 2]
    for u in (0, 1, 2):
        assert torch.equal(sw.load(u), ws[u])
    assert sw.read_from_memory_bytes == (sw.numels[1] + sw.numels[2]) * 2
    sw.close()


def test_no_hold_by_default_and_trim_hands_everything_back(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    plain = _shards(tmp_path / "a", hold=0)
    _write_unit(plain, 0, gen)
    assert not plain.held
    plain.close()
    sw = _shards(tmp_path / "b", hold=2)
    _write_unit(sw, 0, gen)
    sw.flush()
    assert sw.held and sw._held_bufs
    sw.trim()
    assert not sw.held and not sw._held_bufs and not sw._landed_bufs and not sw._spare
    sw.close()
