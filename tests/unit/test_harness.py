"""The test harness's own guarantee: a spawned job that hangs fails its test after the timeout, naming the
ranks, instead of holding the whole suite (a hung collective is what multi-rank tests exist to catch)."""

from __future__ import annotations

import time

import pytest

from tests.harness import _join, _rank_context


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_hung_rank_is_stopped_and_named(tmp_path) -> None:
    ctx = _rank_context()
    procs = [ctx.Process(target=_sleep, args=(s,)) for s in (0.0, 600.0)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rank\(s\) \[1\] of the spawned job still running after the timeout"
    ):
        _join(procs, str(tmp_path), timeout_s=3.0)
    assert time.monotonic() - t0 < 30 and not procs[1].is_alive()
