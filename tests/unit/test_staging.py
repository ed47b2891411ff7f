"""The offload transport's logic on the host: bounded staging chunks, one allocation, the same results.

On a GPU the same code moves data between device and pinned buffers on a side stream (tests/gpu covers
that); here the buffers are plain host memory and the events are null, so every chunking and conversion
rule runs in the CPU suite.
"""

from __future__ import annotations

import pytest
import torch

import zoff.engine.zero as zero_mod
from zoff.checkpoint.format import rng_states, set_rng_states
from zoff.config import OffloadOptimizerConfig, OptimConfig, ZeroConfig
from zoff.engine import build_engine
from zoff.engine.staging import Staging, chunk_bytes
from zoff.launch.elastic import pg_timeout_s
from zoff.models.gpt import GPT

CPU = torch.device("cpu")


def test_download_converts_through_bounded_chunks() -> None:
    st = Staging(8192, CPU)
    assert st.nbytes == 2 * chunk_bytes(8192) == 8192 and st.pinned_bytes == 0  # host-only: nothing pinned
    ptrs = [b.data_ptr() for b in st.buffers]
    src = torch.randn(10_001, dtype=torch.bfloat16)
    dst = torch.empty(10_001, dtype=torch.float32)
    st.download(src, dst)
    assert torch.equal(dst, src.float())
    assert st.chunks == -(-src.numel() * 2 // 4096)  # 4096-byte chunks of 2-byte elements
    src32 = torch.randn(3, 1000)
    dst32 = torch.empty(3000)
    st.download(src32, dst32)
    assert torch.equal(dst32, src32.flatten())
    assert [b.data_ptr() for b in st.buffers] == ptrs  # never reallocated


def test_upload_rounds_on_the_host_like_to() -> None:
    st = Staging(4096, CPU)
    master = torch.randn(5000)
    shard = torch.empty(5000, dtype=torch.bfloat16)
    st.upload(master, shard)
    st.uploads_done()
    assert torch.equal(shard, master.to(torch.bfloat16))
    assert st.chunks == -(-5000 * 2 // chunk_bytes(4096)) == 3  # a chunk is at least a page


def _train(eng, steps: int, after_step=None) -> tuple[list[float], torch.Tensor]:
    """`steps` steps of a logsumexp loss on fixed random tokens: their losses, and the last batch."""
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        eng.zero_grad()
        x = torch.randint(0, 64, (2, 16), generator=gen)
        loss = eng.model(x).float().logsumexp(-1).mean()
        eng.backward(loss)
        eng.step(1e-2)
        losses.append(loss.item())
        if after_step is not None:
            after_step()
    return losses, x


def _run(precision: str, delay: bool, clip: float, staged: bool, monkeypatch) -> tuple[list, list, Staging]:
    monkeypatch.setattr(zero_mod, "needs_staging", lambda device: staged)
    torch.manual_seed(0)
    model = GPT(2, 2, 32, 64, 16)
    zero = ZeroConfig(
        stage=2, offload_optimizer=OffloadOptimizerConfig(device="cpu", delay_update=delay, staging_mb=1)
    )
    eng = build_engine(
        model, zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision=precision, grad_clip=clip
    )
    grad_ptrs = []
    losses, _ = _train(
        eng,
        4,
        lambda: grad_ptrs.append(
            [g.data_ptr() if g is not None else 0 for g in eng.optimizer.tier.host_grads]
        ),
    )
    eng.flush()
    return losses, [m.clone() for m in eng.masters], eng, grad_ptrs


@pytest.mark.parametrize(
    ("precision", "delay", "clip"), [("bf16", True, 0.05), ("bf16", False, 1e9), ("fp32", True, 0.05)]
)
def test_staged_offload_equals_the_direct_copies(precision, delay, clip, monkeypatch) -> None:
    """The engine with every host<->device copy going through 1 MiB of staging (as on a GPU) gives the same
    losses and masters, bit for bit, as the direct copies; the host gradient buffers are allocated once
    (clip 0.05 rescales some steps to fp32 and not others)."""
    want_losses, want_masters, _, _ = _run(precision, delay, clip, False, monkeypatch)
    losses, masters, eng, ptrs = _run(precision, delay, clip, True, monkeypatch)
    assert eng.staging is not None and eng.staging.chunks > 0
    assert eng.memory_report()["cpu_staging"] == 2 * chunk_bytes(1 << 20)
    assert losses == want_losses
    for a, b in zip(masters, want_masters, strict=True):
        assert torch.equal(a, b)
    assert all(p == ptrs[0] for p in ptrs)


def test_offloaded_states_are_not_pinned(monkeypatch) -> None:
    """Only the staging buffers may be page-locked; the fp32 master and moments stay pageable."""
    _, _, eng, _ = _run("bf16", False, 1e9, True, monkeypatch)
    opt = eng.optimizer
    assert not any(t.is_pinned() for t in opt.masters + opt.exp_avg + opt.exp_avg_sq)
    assert eng.pinned_bytes() == 0  # host-only run: nothing pinned at all


def test_rng_states_round_trip_and_skip_cuda_on_the_host() -> None:
    torch.manual_seed(3)
    states = rng_states(CPU)
    assert set(states) == {"cpu"}
    want = torch.rand(4)
    set_rng_states(
        {**states, "cuda": torch.zeros(16, dtype=torch.uint8)}, CPU
    )  # a GPU checkpoint, resumed here
    assert torch.equal(torch.rand(4), want)


def test_nccl_watchdog_waits_longer_than_zoffs_own_timeout() -> None:
    assert pg_timeout_s("gloo", 600.0) == 600.0
    assert pg_timeout_s("nccl", 600.0) == 1200.0


@pytest.mark.parametrize("per_unit", [True, False])
def test_the_overlapped_forward_waits_for_its_own_units_uploads(per_unit: bool, monkeypatch) -> None:
    """Stage 3 with overlap_step through the staging (as on a GPU): each trainable unit's publication in the
    walk ends with a mark (Staging.mark, an event on the side stream there), and the next forward's reader of
    that unit waits for that mark, not for every upload queued so far (issue 54's item 4); the same bits as
    the step run first. PER_UNIT_UPLOAD_WAIT off (gpu_bench's +wait-all): no marks, every upload ordered."""
    from zoff.config import OffloadParamConfig
    from zoff.engine.step import overlap

    monkeypatch.setattr(zero_mod, "needs_staging", lambda device: True)
    monkeypatch.setattr(overlap, "PER_UNIT_UPLOAD_WAIT", per_unit)

    def run(overlapped: bool) -> tuple[list[float], object, list, list]:
        zero = ZeroConfig(
            stage=3, param_persistence_threshold=64, offload_param=OffloadParamConfig(device="none"),
            offload_optimizer=OffloadOptimizerConfig(device="cpu", staging_mb=1, overlap_step=overlapped),
        )  # fmt: skip
        torch.manual_seed(0)
        eng = build_engine(
            GPT(2, 2, 32, 64, 16), zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision="bf16"
        )
        issued, waited, st = [], [], eng.staging
        st.mark = lambda: issued.append(("mark", len(issued))) or issued[-1]
        st.wait_for = waited.append
        done = st.uploads_done
        ordered = []
        st.uploads_done = lambda: (ordered.append(1), done())
        losses, x = _train(eng, 3)
        with torch.no_grad():
            losses.append(eng.model(x).float().sum().item())  # the last walk's parameters, read by a forward
        eng.flush()
        return losses, eng, issued, waited, ordered

    want, plain, _, _, _ = run(False)
    got, eng, issued, waited, ordered = run(True)
    assert eng.overlap is not None and got == want
    units = len(eng.plan.units)
    if per_unit:
        assert len(issued) == 3 * units  # a mark per trainable unit per step
        assert set(waited) == set(issued)  # each read by the next forward (backward reads some again)
    else:
        assert issued == [] and waited == [] and len(ordered) >= 3 * units
