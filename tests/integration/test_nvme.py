"""The disk (NVMe) tier for optimizer states: the same arithmetic as CPU offload, only the storage differs, so
per-step losses and final parameters are bitwise equal to it; states stream through three unit buffers; the
swap files are O_DIRECT where the filesystem allows and are gone after a clean exit."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.harness import reference_run, run_zoff, tiny_cfg
from zoff.config import IoConfig, OffloadOptimizerConfig, OptimConfig, ZeroConfig, config_from_dict
from zoff.engine import build_engine
from zoff.engine.disk_io import AlignedBuffer, SwapFile
from zoff.errors import ConfigError
from zoff.models.gpt import GPT

DISK = Path(os.environ.get("ZOFF_TEST_NVME_DIR", "/var/tmp"))  # a real disk: /tmp may be tmpfs elsewhere


@pytest.fixture
def swap(tmp_path: Path):
    """A fresh folder on the real disk (tmp_path when there is none), removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="zoff-test-", dir=DISK)) if DISK.is_dir() else tmp_path / "swap"
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _offload(device: str, swap: Path, delay: bool = False) -> dict:
    return {"device": device, "nvme_path": str(swap) if device == "nvme" else None, "delay_update": delay,
            "io": {"threads": 2, "request_mb": 1}}  # fmt: skip


def _engine_run(stage: int, precision: str, device: str, swap: Path, steps: int = 5):
    torch.manual_seed(0)
    model = GPT(2, 2, 32, 64, 16)
    zero = ZeroConfig(
        stage=stage, reduce_bucket_size=1500, param_persistence_threshold=64,
        offload_optimizer=OffloadOptimizerConfig(
            device=device, nvme_path=str(swap) if device == "nvme" else None, io=IoConfig(threads=2, request_mb=1)
        ),
    )  # fmt: skip
    eng = build_engine(model, zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision=precision, grad_clip=0.05,
                       grad_accum=2)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        eng.zero_grad()
        for micro in range(2):
            x = torch.randint(0, 64, (2, 16), generator=gen)
            loss = eng.model(x).float().logsumexp(-1).mean() / 2
            eng.backward(loss, sync=micro == 1)
        eng.step(1e-2)
        losses.append(loss.item())
    params = eng.gathered_params()
    return losses, params, eng


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nvme_is_bitwise_cpu_offload_in_process(stage: int, precision: str, swap: Path) -> None:
    want_losses, want, _ = _engine_run(stage, precision, "cpu", swap)
    losses, got, eng = _engine_run(stage, precision, "nvme", swap)
    assert len(eng.plan.units) >= 3  # several units: the read-ahead / write-back rotation really runs
    assert losses == want_losses
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    swap_file = swap / "rank0" / "optimizer.swap"
    assert swap_file.is_file() and eng.optimizer.states.file.written_bytes > 0
    mem = eng.memory_report()
    assert mem["disk_optimizer_states"] == eng.planned_memory()["disk_optimizer_states"] > 0
    assert mem["cpu_optimizer_states"] == eng.planned_memory()["cpu_optimizer_states"]
    eng.close()
    assert not swap_file.exists()  # removed at a clean exit


@pytest.mark.slow
def test_nvme_on_two_ranks_equals_cpu_offload_and_the_reference(swap: Path) -> None:
    results = {}
    for device in ("cpu", "nvme"):
        cfg = tiny_cfg(
            zero={"stage": 2, "reduce_bucket_size": 3000, "offload_optimizer": _offload(device, swap)},
            train={"max_steps": 6, "grad_accum": 2, "grad_clip": 0.5, "precision": "fp32"},
        )
        results[device] = run_zoff(cfg, 2)[0]
    a, b = results["cpu"], results["nvme"]
    assert a["losses"] == b["losses"]
    for name, p in a["params"].items():
        assert torch.equal(b["params"][name], p), name
    ref = reference_run(config_from_dict(cfg), 2)
    for x, y in zip(b["losses"], ref["losses"]):
        assert abs(x - y) <= 1e-5 * abs(y)
    assert b["memory"]["disk_optimizer_states"] == b["planned"]["disk_optimizer_states"]
    assert not any((swap / f"rank{r}" / "optimizer.swap").exists() for r in range(2))


def test_swap_file_uses_o_direct_on_a_real_disk_and_round_trips(swap: Path) -> None:
    f = SwapFile(swap / "t.swap", 3 << 20, threads=3, request_bytes=1 << 20)
    try:
        if DISK.is_dir():
            assert f.direct  # ext4/xfs: no page cache between the tier and the disk
        buf, back = AlignedBuffer(3 << 20), AlignedBuffer(3 << 20)
        buf.bytes.copy_(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8))
        for fut in f.write(buf.bytes, 0):
            fut.result()
        for fut in f.read(back.bytes, 0):
            fut.result()
        assert torch.equal(buf.bytes, back.bytes)
    finally:
        f.close()
    assert not f.path.exists()


def test_nvme_without_a_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="zero.offload_optimizer.nvme_path: device nvme needs a directory"):
        config_from_dict({"zero": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.mark.slow
def test_the_disk_tier_holds_its_buffers_in_ram_not_the_shard(swap: Path) -> None:
    """1.07 GB of optimizer states (89M fp32 params x 12 B) stepped from disk: the process's peak memory grows
    by what the plan says (params, grads and the tier's unit buffers; within 10%), not by the states, and
    the page cache does not take them in either (O_DIRECT)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak, to the current RSS
    except OSError:
        pytest.skip("needs /proc/self/clear_refs")
    with torch.device("meta"):
        model = GPT(8, 8, 960, 256, 16)
    zero = ZeroConfig(
        stage=1, reduce_bucket_size=4_000_000,
        offload_optimizer=OffloadOptimizerConfig(device="nvme", nvme_path=str(swap)),
    )  # fmt: skip
    cached, before = _meminfo("Cached"), _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    eng = build_engine(model, zero, OptimConfig())
    for _ in range(2):
        eng.zero_grad()
        eng.backward(eng.model(torch.randint(0, 256, (1, 16))).float().logsumexp(-1).mean())
        eng.step(1e-3)
    grew = _status("VmHWM") - before
    planned = eng.planned_memory()
    disk = planned.pop("disk_optimizer_states")
    assert disk > 1_000_000_000 and eng.optimizer.states.file.direct
    ram = sum(planned.values())
    assert planned["cpu_optimizer_states"] < disk / 5  # a few units' buffers, not the shard
    assert grew <= 1.10 * ram, (grew, ram)
    assert _meminfo("Cached") - cached < disk / 4, "the swap traffic went through the page cache"
    eng.close()
