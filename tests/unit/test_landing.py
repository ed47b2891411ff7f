"""Gradient landings on their worker thread (engine/comm/landing.py): in order, off the caller's thread, bounded by
the reducer, and an error that stops every later landing and surfaces on the caller's thread each time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import zoff.engine.zero as zero_mod
from zoff.config import OffloadOptimizerConfig, OptimConfig, OptimizerIoConfig, ZeroConfig
from zoff.engine import build_engine
from zoff.engine.comm.landing import Landings
from zoff.engine.comm.reduce import MAX_IN_FLIGHT
from zoff.models.gpt import GPT


def test_landings_run_in_order_on_one_other_thread() -> None:
    q, seen, threads = Landings(), [], set()
    gate = threading.Event()

    def land(k: int):
        def fn() -> None:
            gate.wait(5)  # the caller goes on while the first landing is held
            seen.append(k)
            threads.add(threading.get_ident())

        return fn

    for k in range(5):
        q.submit(land(k))
    assert seen == [] and q.pending == 5  # nothing ran on the caller's thread
    gate.set()
    q.join()
    assert seen == [0, 1, 2, 3, 4] and q.pending == 0 and q.landed == 5
    assert threading.get_ident() not in threads and len(threads) == 1
    q.close()


def test_wait_oldest_waits_for_the_first_only() -> None:
    q, release = Landings(), [threading.Event(), threading.Event()]
    q.submit(lambda: release[0].wait(5))
    q.submit(lambda: release[1].wait(5))
    threading.Timer(0.05, release[0].set).start()
    q.wait_oldest()
    assert q.pending == 1  # the second is still held
    release[1].set()
    q.join()
    q.close()


def test_a_failed_landing_stops_the_rest_and_raises_every_time() -> None:
    q, seen = Landings(), []

    def boom() -> None:
        raise OSError(28, "No space left on device")

    q.submit(lambda: seen.append(0))
    q.submit(boom)
    q.submit(lambda: seen.append(2))  # queued behind the failure: must not land
    with pytest.raises(OSError, match="No space left"):
        q.join()
    assert seen == [0]
    with pytest.raises(RuntimeError, match="landing failed earlier.*No space left") as err:  # sticky
        q.submit(lambda: seen.append(3))
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="incomplete"):
        q.join()
    time.sleep(0.05)
    assert seen == [0]
    q.close()


def _train(
    monkeypatch, *, overlap: bool, nvme: str | None = None, accum: int = 2
) -> tuple[list, list, object]:
    """Stage 3 with every reduction landing through 1 MiB of host staging (as on a GPU), in host memory or on
    the disk tier."""
    monkeypatch.setattr(zero_mod, "needs_staging", lambda device: True)
    torch.manual_seed(0)
    model = GPT(2, 2, 32, 64, 16)
    oo = (
        OffloadOptimizerConfig(
            device="nvme", nvme_path=nvme, host_budget="min", io=OptimizerIoConfig(threads=2)
        )
        if nvme
        else OffloadOptimizerConfig(device="cpu", staging_mb=1)
    )
    zero = ZeroConfig(stage=3, overlap_comm=overlap, offload_optimizer=oo, param_persistence_threshold=64)
    eng = build_engine(
        model,
        zero,
        OptimConfig(lr=1e-2, weight_decay=0.1),
        precision="bf16",
        grad_clip=0.05,
        grad_accum=accum,
    )
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        eng.zero_grad()
        for micro in range(accum):
            x = torch.randint(0, 64, (2, 16), generator=gen)
            loss = eng.model(x).float().logsumexp(-1).mean() / accum
            eng.backward(loss, sync=micro == accum - 1)
        losses.append(eng.step(1e-2).grad_norm)
    eng.flush()
    return losses, eng.gathered_params(), eng


@pytest.mark.parametrize("tier", ["staged", "disk"])
def test_worker_landings_equal_inline_ones(tier, monkeypatch, tmp_path) -> None:
    """Accumulating two micro-batches (the second landing adds into the first), with clipping: the landings
    run on the worker give the norms and parameters of the inline landings bit for bit."""
    nvme = None if tier == "staged" else str(tmp_path / "a")
    want_norms, want, inline = _train(monkeypatch, overlap=False, nvme=nvme)
    assert inline.reducer.landings is None
    nvme = None if tier == "staged" else str(tmp_path / "b")
    norms, got, eng = _train(monkeypatch, overlap=True, nvme=nvme)
    assert len(eng.plan.units) > 2  # (blocks and the root: landings of several units interleave)
    assert eng.reducer.landings is not None and eng.reducer.landings.landed >= 2 * 3 * len(eng.plan.units)
    assert norms == want_norms
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    # the reduced shards waiting to land and in flight stay within the MAX_IN_FLIGHT + 1 the estimate counts
    red = eng.reducer
    assert red.direct and red._pool.peak_bytes <= (MAX_IN_FLIGHT + 1) * red._max_shard * 2


def test_a_landing_error_fails_backward_the_step_and_the_next_backward(monkeypatch, tmp_path) -> None:
    """A landing that fails (the disk full) raises from backward on the caller's thread; a caller that goes
    on anyway gets no step and no backward on the window it missed; close() still stops the thread."""
    _, _, eng = _train(monkeypatch, overlap=True, nvme=str(tmp_path / "c"), accum=1)
    store = eng.reducer.grads

    def full(*args, **kwargs) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "land", full)
    x = torch.randint(0, 64, (2, 16))
    eng.zero_grad()
    with pytest.raises(OSError, match="No space left"):
        eng.backward(eng.model(x).float().logsumexp(-1).mean())
    with pytest.raises(RuntimeError, match="landing failed earlier"):
        eng.step(1e-2)
    with pytest.raises(RuntimeError, match="landing failed earlier"):
        eng.zero_grad()
        eng.backward(eng.model(x).float().logsumexp(-1).mean())
    eng.close()
    assert eng.reducer.landings._pool is None  # the worker is stopped


def test_a_backward_that_raises_leaves_no_landing_running(monkeypatch, tmp_path) -> None:
    """An error inside backward (here a hook's, half-way) returns only after the landings already queued
    are done: nothing changes the gradient store behind the caller's back."""
    _, _, eng = _train(monkeypatch, overlap=True, nvme=str(tmp_path / "d"), accum=1)
    store, landing = eng.reducer.grads, threading.Event()
    land = store.land

    def slow(*args, **kwargs) -> None:
        time.sleep(0.2)
        land(*args, **kwargs)
        landing.set()

    monkeypatch.setattr(store, "land", slow)
    calls = []
    real = eng.reducer._track

    def track(*args, **kwargs) -> None:
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("a hook failed")

    monkeypatch.setattr(eng.reducer, "_track", track)
    eng.zero_grad()
    with pytest.raises(KeyError, match="a hook failed"):
        eng.backward(eng.model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean())
    assert landing.is_set() and eng.reducer.landings.pending == 0
