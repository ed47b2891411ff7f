"""DPU (zero.offload_optimizer.delay_update) on the disk tier: the delayed step runs beside the next forward and
backward, reading one gradient file while backward writes the other and writing the new parameter shards into
the parameter file's other slot. Its numbers are DPU's in host memory, bit for bit, at every host budget; its
swap files and bytes per step are the estimate's; over real ranks it is the documented one-step staleness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import reference_run, run_zoff, tiny_cfg
from tests.integration.test_nvme import _engine_run, _offload
from zoff.config import config_from_dict
from zoff.engine import build_engine
from zoff.engine.disk.grad_swap import DelayedDiskGrads

STATE_KEYS = ("params", "grads", "optimizer_states", "cpu_params", "cpu_grads", "cpu_optimizer_states")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dpu_with_parameters_in_memory_publishes_from_its_own_file(precision: str, swap: Path) -> None:
    """zero2-nvme under DPU: the delayed step writes the new shards to a file of their own, read back once it
    is done; the numbers are DPU's in host memory, bit for bit; the files are the estimate's."""
    want_losses, want, ref = _engine_run(2, precision, "cpu", swap, delay=True)
    ref.close()
    losses, got, eng = _engine_run(2, precision, "nvme", swap, delay=True)
    assert losses == want_losses
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    mem, planned = eng.memory_report(), eng.planned_memory()
    assert eng.next_params is not None and eng.param_disk is None
    assert planned["disk_params"] == eng.next_params.disk_bytes() == mem["disk_params"] > 0
    eng.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dpu_on_disk_is_bitwise_dpu_in_host_memory(precision: str, swap: Path) -> None:
    want_losses, want, ref = _engine_run(3, precision, "cpu", swap, params="cpu", delay=True)
    ref.close()
    exact_losses, _, exact = _engine_run(3, precision, "nvme", swap, params="nvme")
    exact.close()
    assert exact_losses != want_losses, "the delayed runs must differ from the exact one (DPU really ran)"
    # every state on disk with both gradient files; the gradient shard in RAM instead; everything in RAM
    for budget, grad_device, on_disk in (
        ("min", "auto", True),
        ("min", "cpu", False),
        ("auto", "auto", False),
    ):
        losses, got, eng = _engine_run(
            3, precision, "nvme", swap, params="nvme", delay=True, budget=budget, grad_device=grad_device
        )
        cell = (budget, grad_device)
        assert losses == want_losses, cell
        for name, p in want.items():
            assert torch.equal(got[name], p), (cell, name)
        assert isinstance(eng.grads, DelayedDiskGrads) == on_disk, cell
        mem, planned = eng.memory_report(), eng.planned_memory()
        assert {k: mem[k] for k in STATE_KEYS} == {k: planned[k] for k in STATE_KEYS}, cell
        # the parameter file holds the trainable shards twice (the slot the forward reads, the one DPU writes)
        assert planned["disk_params"] == eng.param_disk.disk_bytes() == mem["disk_params"], cell
        assert planned["disk_grads"] == eng.grads.disk_bytes() == mem["disk_grads"], cell
        eng.close()


@pytest.mark.parametrize(("stage", "params"), [(3, "nvme"), (2, "none")])
def test_dpu_on_disk_moves_the_bytes_the_estimate_says(stage: int, params: str, swap: Path) -> None:
    """zero3-nvme and zero2-nvme under DPU, every state on disk: two whole steps (each from one publication to
    the next) read and write what `zoff estimate` says per step, and the files are its sizes."""
    from zoff.planning import memory

    oo = {**_offload("nvme", swap, delay=True), "delay_update_warmup": 1}
    zero = {"stage": stage, "reduce_bucket_size": 3000, "param_persistence_threshold": 64,
            "offload_optimizer": oo, "offload_param": {"device": params}}  # fmt: skip
    cfg = config_from_dict(tiny_cfg(zero=zero, train={"grad_accum": 1}))
    row = memory.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 1, 1, "cpu").get(
        memory.Policy(stage, "nvme", params)
    )
    torch.manual_seed(0)
    eng = build_engine(memory.meta_model(cfg.model), cfg.zero, cfg.optim, grad_clip=0.5)
    params_file = eng.param_disk if eng.param_disk is not None else eng.next_params
    files = (eng.optimizer.states.file, params_file.file, *eng.grads.files)
    assert row.disk == sum(f.nbytes for f in files)
    x = torch.randint(0, 256, (2, 16))

    def step() -> None:
        eng.zero_grad()
        eng.backward(eng.model(x).float().logsumexp(-1).mean())
        eng.step(1e-3)

    for _ in range(3):  # the exact warm-up step, a delayed one, and the steady state's first
        step()
    eng.flush()
    r0, w0 = sum(f.read_bytes for f in files), sum(f.written_bytes for f in files)
    for _ in range(2):
        step()
    eng.flush()  # the second step's update, published
    read, written = sum(f.read_bytes for f in files) - r0, sum(f.written_bytes for f in files) - w0
    # At most the estimate: a piece whose bytes a ring buffer still holds is not read again, which depends on
    # when the write-backs land (at most the ring's worth of pieces a step)
    states = eng.optimizer.states
    ring = states.n_buffers * 3 * max(states.part)
    assert 2 * (row.disk_read - ring) <= read <= 2 * row.disk_read, (read, row.disk_read, ring)
    assert written == 2 * row.disk_written
    eng.close()


def test_dpu_on_disk_over_two_ranks_is_one_step_stale(swap: Path) -> None:
    """zero3-nvme with DPU over two gloo ranks: the losses and parameters of plain PyTorch applying each update
    one step late (after the exact warm-up steps), within 1e-5; the same twice."""
    oo = {**_offload("nvme", swap, delay=True), "delay_update_warmup": 3}
    zero = {"stage": 3, "param_persistence_threshold": 64, "offload_optimizer": oo,
            "offload_param": {"device": "nvme"}}  # fmt: skip
    cfg = tiny_cfg(zero=zero, train={"max_steps": 8})
    got = run_zoff(cfg, 2)[0]
    stale = reference_run(config_from_dict(cfg), 2, delay_warmup=3)
    for step, (a, b) in enumerate(zip(got["losses"], stale["losses"], strict=True), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: zoff {a!r} vs one-step-stale reference {b!r}"
    for name, p in stale["params"].items():
        assert (got["params"][name] - p).abs().max().item() <= 1e-5 * max(p.abs().max().item(), 1.0), name
