"""Which writes a gather waits for (param_swap.SwappedShards): every write into a region gathers read, and
none into the other regions. A unit speculation flipped is live in slot 1 while `slot` stays 0: the schedule
harness's seeds 1148, 1345 and 1430 read such a unit while its walk's write-back was still on its way (a gather
flushed slot 0's writes alone) and trained on the shard before it. Writes here are held at a gate, so the
order is the one asked for, never a race the test may lose."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from zoff.engine.disk import swapfile
from zoff.engine.disk.param_swap import SwappedShards

PAGE = 4096


class Gate:
    """Holds every pwritev at the gate until open() (reads pass); counts the writes waiting."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.opened, self.waiting = threading.Event(), threading.Semaphore(0)
        real = swapfile._full

        def full(op, *args):
            if op is os.pwritev:
                self.waiting.release()
                self.opened.wait(timeout=60)
            return real(op, *args)

        monkeypatch.setattr(swapfile, "_full", full)

    def open(self) -> None:
        self.opened.set()


def _flipped(tmp_path: Path) -> tuple[SwappedShards, torch.Tensor]:
    """Units 0 and 1, unit 0 with a second region and flipped into it (a committed speculative shard)."""
    sw = SwappedShards(
        {0: PAGE, 1: PAGE}, torch.bfloat16, tmp_path, threads=2, request_bytes=1 << 20,
        slotted=frozenset({0}), lazy_slots=True,
    )  # fmt: skip
    sw.allocate_second()
    committed = torch.full((PAGE,), 1.0)
    sw.write_second(0, 0, committed)
    sw.flip_units([0])
    assert sw.live(0) == 1 and sw.slot == 0
    return sw, committed


def test_a_gather_of_a_flipped_unit_waits_for_its_write_back(tmp_path: Path, monkeypatch) -> None:
    sw, _ = _flipped(tmp_path)
    gate = Gate(monkeypatch)
    newer = torch.full((PAGE,), 2.0)
    sw.write(0, 0, newer)  # the walk's write-back, into slot 1: held at the gate
    assert gate.waiting.acquire(timeout=30)
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(sw.load(0)))
    reader.start()
    reader.join(timeout=1.0)
    assert reader.is_alive() and not got  # the gather waits: the write has not landed
    gate.open()
    reader.join(timeout=30)
    assert torch.equal(got[0], newer.to(torch.bfloat16))
    sw.close()


def test_the_end_of_a_step_waits_for_a_flipped_units_write_back(tmp_path: Path, monkeypatch) -> None:
    """The step's own flush (zero.py, before the next forward) covers slot 1's live regions too."""
    sw, _ = _flipped(tmp_path)
    gate = Gate(monkeypatch)
    sw.write(0, 0, torch.full((PAGE,), 3.0))
    assert gate.waiting.acquire(timeout=30)
    done = threading.Event()
    flusher = threading.Thread(target=lambda: (sw.flush(live_only=True), done.set()))
    flusher.start()
    flusher.join(timeout=1.0)
    assert not done.is_set()
    gate.open()
    flusher.join(timeout=30)
    assert done.is_set() and not sw.writes
    sw.close()


def test_a_gather_does_not_wait_for_a_speculative_write(tmp_path: Path, monkeypatch) -> None:
    """A speculative piece goes to the region gathers do not read: backward's gathers go on beside it."""
    sw, committed = _flipped(tmp_path)
    gate = Gate(monkeypatch)
    sw.write_second(0, 0, torch.full((PAGE,), 4.0))  # into slot 0, now the dead one: held at the gate
    assert gate.waiting.acquire(timeout=30)
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(sw.load(0)))
    reader.start()
    reader.join(timeout=10)
    done = not reader.is_alive()
    gate.open()
    reader.join(timeout=30)
    assert done, "the gather waited for a write into the region it does not read"
    assert torch.equal(got[0], committed.to(torch.bfloat16))  # the live shard
    sw.close()
