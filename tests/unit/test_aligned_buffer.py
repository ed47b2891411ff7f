"""The disk tier's I/O buffers (disk/swapfile.AlignedBuffer) ask for transparent huge pages: O_DIRECT pins every
page of a request, and on this project's machines 2 MiB pages cut the kernel's time per byte 5-7x
(scripts/bench_io_contention.py). Checked where it shows: the mapping's AnonHugePages in /proc/self/smaps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zoff.engine.disk.swapfile import ALIGN, AlignedBuffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mode() -> str:
    text = THP.read_text() if THP.exists() else "[never]"
    return text[text.index("[") + 1 : text.index("]")]


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that contains `addr`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(_mode() == "never", reason="transparent huge pages are off on this host")
def test_a_large_buffer_is_backed_by_huge_pages_a_small_one_is_not_asked() -> None:
    big = AlignedBuffer(16 << 20)
    big.bytes.fill_(1)  # the pages exist once touched
    assert _anon_huge_kib(big.bytes.data_ptr()) > 0
    assert big.bytes.data_ptr() % ALIGN == 0 and big.nbytes == 16 << 20
    if _mode() == "madvise":  # (with "always" every large anonymous map gets them anyway)
        plain = AlignedBuffer(16 << 20, huge_pages=False)
        plain.bytes.fill_(1)
        assert _anon_huge_kib(plain.bytes.data_ptr()) == 0
    small = AlignedBuffer(8192)  # below 2 MiB: plain pages, nothing to ask
    assert small.nbytes == 8192 and small.view(torch.float32, 0, 2048).numel() == 2048


@pytest.mark.parametrize("part", [2 << 20, 32 << 20, (32 << 20) + 4096 * 3])
def test_a_pieces_states_lie_apart_in_the_cache_and_inside_its_ram(part: int) -> None:
    """On huge pages an offset is a cache set: master, moments and the gradient (its buffer starts on a huge
    page, offset 0) must not share one, or the CPU Adam's four streams fight over it (placement.SKEW)."""
    from zoff.engine.disk.placement import SKEW, WAY, kind_offset, piece_ram_bytes

    at = [kind_offset(part, k) for k in range(3)]
    sets = sorted([0, *(a % WAY for a in at)])
    if part % WAY == 0:
        assert min(b - a for a, b in zip(sets, sets[1:], strict=False)) >= SKEW  # a quarter way apart
    assert len(set(sets)) == 4
    assert all(a % ALIGN == 0 for a in at) and at[0] > 0  # O_DIRECT-aligned, clear of the gradient's offset
    assert at[1] >= at[0] + part and at[2] >= at[1] + part  # no overlap
    ram = piece_ram_bytes(part)
    assert (
        at[2] + part <= ram < 3 * part + 3 * SKEW + WAY and ram % WAY == 0
    )  # whole ways: the next piece too


def test_a_piece_smaller_than_a_huge_page_keeps_the_plain_layout() -> None:
    from zoff.engine.disk.placement import kind_offset, piece_ram_bytes

    part = 64 << 10
    assert [kind_offset(part, k) for k in range(3)] == [0, part, 2 * part] and piece_ram_bytes(
        part
    ) == 3 * part
