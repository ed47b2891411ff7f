"""The disk (NVMe) tier for optimizer states: the same arithmetic as CPU offload, only the storage differs, so
per-step losses and final parameters are bitwise equal to it; states stream through five unit buffers; the
swap files are O_DIRECT where the filesystem allows and are gone after a clean exit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import DISK
from tests.forked_zoff import zoff_run
from tests.harness import assert_close_params, reference_run, run_zoff, tiny_cfg
from zoff.checkpoint import save_checkpoint
from zoff.config import (
    IoConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimConfig,
    OptimizerIoConfig,
    ZeroConfig,
    config_from_dict,
)
from zoff.engine import build_engine
from zoff.engine.disk.placement import RING
from zoff.engine.disk.swapfile import AlignedBuffer, SwapFile, filesystem_type
from zoff.errors import ConfigError, UserError
from zoff.models.gpt import GPT


def _offload(device: str, swap: Path, delay: bool = False) -> dict:
    return {"device": device, "nvme_path": str(swap) if device == "nvme" else None, "delay_update": delay,
            "io": {"threads": 2, "request_mb": 1}, "host_budget": "min"}  # fmt: skip


def _engine_run(
    stage: int, precision: str, device: str, swap: Path, steps: int = 5, bucket: int = 1500, params: str = "none",
    prefetch: int = 3_000_000, layers: int = 2, budget: str = "min", delay: bool = False, grad_device: str = "auto",
):  # fmt: skip
    torch.manual_seed(0)
    model = GPT(layers, 2, 32, 64, 16)
    zero = ZeroConfig(
        stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=64, prefetch_bucket_size=prefetch,
        offload_optimizer=OffloadOptimizerConfig(
            device=device, nvme_path=str(swap) if device == "nvme" else None, io=OptimizerIoConfig(threads=2, request_mb=1),
            host_budget=budget, delay_update=delay, delay_update_warmup=1 if delay else 0,
            grad_device=grad_device if device == "nvme" else "auto",
        ),
        offload_param=OffloadParamConfig(device=params, io=IoConfig(threads=2, request_mb=1)),
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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameters_on_disk_are_bitwise_parameters_in_host_memory(precision: str, swap: Path) -> None:
    """Stage 3 with both offloads on disk against both in host memory: only the storage differs."""
    want_losses, want, _ = _engine_run(3, precision, "cpu", swap, params="cpu")
    losses, got, eng = _engine_run(3, precision, "nvme", swap, params="nvme")
    assert losses == want_losses
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    disk = eng.param_disk
    assert disk.file.read_bytes > 0 and disk.file.written_bytes > 0  # gathered from and written back to disk
    mem = eng.memory_report()
    assert mem["disk_params"] == eng.planned_memory()["disk_params"] > 0
    assert mem["params"] == eng.planned_memory()["params"]  # only the persistent units stay in memory
    eng.close()
    assert not (swap / "rank0").exists()  # both swap files and the rank's folder removed at a clean exit


def test_parameters_on_disk_read_the_next_block_ahead(swap: Path) -> None:
    """A block's shards come from disk, slower than the compute they would stall: the next block is read (and
    gathered) ahead even when prefetch_bucket_size reaches nothing; the estimate's working set holds it."""
    from zoff.planning.memory import stage3_working_set

    peaks, engines = {}, {}
    for params in ("cpu", "nvme"):
        device = "nvme" if params == "nvme" else "cpu"
        losses, _, eng = _engine_run(3, "fp32", device, swap, steps=2, params=params, prefetch=1, layers=4)
        peaks[params], engines[params] = eng.gatherer.peak_gathered, (eng, losses)
    eng = engines["nvme"][0]
    assert engines["nvme"][1] == engines["cpu"][1]  # reading ahead changes no number
    block = max(
        sum(4 * u.padded for u in eng.plan.all_units if u.modules == (f"blocks.{i}",)) for i in range(4)
    )
    assert peaks["nvme"] >= peaks["cpu"] + block  # one more block held: the one read ahead
    assert peaks["nvme"] <= 4 * stage3_working_set(eng.plan, eng.zero)
    for e, _ in engines.values():
        e.close()


# Every stage with the optimizer on disk, and stage 3 with parameters on disk too, in fp32 and bf16: three
# cells in the default run, the rest in the grid (`-m grid`).
_DEFAULT = {(2, "none", "fp32"), (3, "nvme", "fp32"), (3, "nvme", "bf16")}
TWO_RANKS = [
    pytest.param(*cell, marks=() if cell in _DEFAULT else pytest.mark.grid)
    for cell in [(s, "none", p) for s in (1, 2, 3) for p in ("fp32", "bf16")]
    + [(3, "nvme", "fp32"), (3, "nvme", "bf16")]
]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "params", "precision"), TWO_RANKS)
def test_nvme_on_two_ranks_equals_cpu_offload_and_the_reference(
    stage: int, params: str, precision: str, swap: Path
) -> None:
    results = {}
    for device in ("cpu", "nvme"):
        zero = {"stage": stage, "reduce_bucket_size": 3000, "offload_optimizer": _offload(device, swap),
                "param_persistence_threshold": 64,
                "offload_param": {"device": {"none": "none", "nvme": device}[params]}}  # fmt: skip
        cfg = tiny_cfg(
            zero=zero, train={"max_steps": 6, "grad_accum": 2, "grad_clip": 0.5, "precision": precision}
        )
        results[device] = run_zoff(cfg, 2)[0]
    a, b = results["cpu"], results["nvme"]
    assert a["losses"] == b["losses"]
    for name, p in a["params"].items():
        assert torch.equal(b["params"][name], p), name
    if precision == "fp32":
        ref = reference_run(config_from_dict(cfg), 2)
        for x, y in zip(b["losses"], ref["losses"]):
            assert abs(x - y) <= 1e-5 * abs(y)
        assert_close_params(b["params"], ref["params"])
    for key in ("disk_optimizer_states", "disk_params"):
        assert b["memory"][key] == b["planned"][key]
    assert (b["memory"]["disk_params"] > 0) == (params == "nvme")
    assert not any((swap / f"rank{r}").exists() for r in range(2))


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
    the page cache does not take them in either (O_DIRECT); saving a checkpoint of them holds a unit or two."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak, to the current RSS
    except OSError:
        pytest.skip("needs /proc/self/clear_refs")
    with torch.device("meta"):
        model = GPT(8, 8, 960, 256, 16)
    zero = ZeroConfig(
        stage=1, reduce_bucket_size=4_000_000,
        offload_optimizer=OffloadOptimizerConfig(device="nvme", nvme_path=str(swap), host_budget="min"),
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
    assert (
        planned["cpu_optimizer_states"] < disk / 4
    )  # the ring's five unit buffers of eight units, not the shard
    assert grew <= 1.10 * ram, (grew, ram)
    assert _meminfo("Cached") - cached < disk / 4, "the swap traffic went through the page cache"
    # A checkpoint of it streams unit by unit: RAM grows by a unit's state or two, not by the 1.07 GB shard.
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    path = save_checkpoint(eng, swap / "ckpt", 2, {"step": 2}, "{}")
    grew = _status("VmHWM") - before
    largest = 4 * max(u.shard for u in eng.plan.units)
    # (the checkpoint holds the states, not speculate auto's second slots beside them)
    assert (path / "shard_00000.safetensors").stat().st_size > (disk - eng.second.state_bytes) * 0.99
    assert grew <= 3 * largest + 32 * 2**20, (grew, largest)
    eng.close()


def _ckpt_cfg(stage: int, micro: int, device: str, swap: Path, ckpt: Path, params: str = "none") -> dict:
    return tiny_cfg(
        zero={
            "stage": stage,
            "reduce_bucket_size": 3000,
            "offload_optimizer": _offload(device, swap),
            "offload_param": {"device": params},
        },  # fmt: skip
        data={"batch_size": micro},
        train={"max_steps": 12, "grad_accum": 1, "global_batch_size": 12},
        checkpoint={"dir": str(ckpt), "every_steps": 6, "keep_last": 5},
    )


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "params"), [(2, "none"), (3, "nvme")])
def test_checkpoint_of_an_nvme_run_resumes_bitwise_and_at_another_world_size(
    stage: int, params: str, swap: Path, tmp_path: Path
) -> None:
    """Saved unit by unit from the swap files; resumed into swap files on 2 ranks (bit for bit against the
    run that never stopped) and into CPU offload on 3 ranks (the states re-partitioned); with stage 3's
    parameters on disk too, read back into their swap file."""
    full = run_zoff(_ckpt_cfg(stage, 6, "nvme", swap, tmp_path / "a", params), 2, tmp_path)[0]
    step6 = str(tmp_path / "a" / "step_00000006")
    again = run_zoff(_ckpt_cfg(stage, 6, "nvme", swap, tmp_path / "b", params), 2, tmp_path, step6)[0]
    assert again["start"] == 6 and again["losses"] == full["losses"][6:]
    for name, p in full["params"].items():
        assert torch.equal(again["params"][name], p), name
    other = run_zoff(_ckpt_cfg(3, 4, "cpu", swap, tmp_path / "c"), 3, tmp_path, step6)[0]
    for a, b in zip(other["losses"], full["losses"][6:]):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)


def test_a_path_in_memory_is_named_in_one_warning(capsys) -> None:
    """tmpfs (which newer kernels let open O_DIRECT) keeps the swap file in RAM: the tier would save nothing."""
    shm = Path("/dev/shm")
    if filesystem_type(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    where = Path(tempfile.mkdtemp(prefix="zoff-test-", dir=shm))
    try:
        SwapFile(where / "t.swap", 1 << 20).close()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and f"{where} is on tmpfs, in memory" in out
    assert filesystem_type(DISK) != "tmpfs" or not DISK.is_dir()


def test_no_space_for_the_swap_file_is_an_error_naming_it(swap: Path) -> None:
    """The space is reserved when the file is made (fallocate): a disk too small fails at start-up, naming
    the file, never mid-step. RLIMIT_FSIZE stands in for a small disk, in a child process."""
    code = f"""
import resource, signal
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from zoff.engine.disk.swapfile import SwapFile
try:
    SwapFile(Path({str(swap)!r}) / "big.swap", 64 << 20)
except OSError as e:
    print("ERR", e)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR zoff: cannot reserve 67,108,864 bytes in" in p.stdout and "big.swap" in p.stdout, (
        p.stdout + p.stderr
    )
    assert not (swap / "big.swap").exists()  # nothing left behind


@pytest.mark.parametrize(
    ("recipe", "key"),
    [("zero2-nvme", "zero.offload_optimizer.nvme_path"), ("zero3-nvme", "zero.offload_param.nvme_path")],
)
def test_train_refuses_a_missing_swap_path_before_any_rank_starts(
    recipe: str, key: str, swap: Path, tmp_path: Path
) -> None:
    """The optimizer's folder, and parameter offload's own one when it names another: checked before any rank
    starts, naming the key."""
    missing = tmp_path / "nope"
    paths = {
        "zero.offload_optimizer.nvme_path": swap,
        key: missing,
    }  # the key under test names the missing one
    # (one of the two in a new interpreter: tests.forked_zoff)
    p = zoff_run(
        ["train", "tiny", f"zero={recipe}", *(f"{k}={v}" for k, v in paths.items()), "--run-dir", str(tmp_path / "run")],
        fresh=recipe == "zero2-nvme",
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == f"zoff: error: {key}: {missing} does not exist (create it on a local disk)"
    assert not (tmp_path / "run").exists() and not missing.exists()


def test_parameters_on_disk_need_the_optimizer_on_disk(swap: Path) -> None:
    p = zoff_run(
        ["validate", "tiny", "zero.stage=3", "zero.offload_optimizer.device=cpu", "zero.offload_param.device=nvme",
         f"zero.offload_param.nvme_path={swap}"],
    )  # fmt: skip
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "zoff: error: zero.offload_param.device: parameter offload to nvme needs zero.offload_optimizer.device nvme"
    )


def test_too_little_space_names_the_path_and_both_sizes(swap: Path, monkeypatch) -> None:
    cfg = config_from_dict(
        tiny_cfg(zero={"stage": 2, "offload_optimizer": _offload("nvme", swap)}, launch={"nproc_per_node": 2})
    )
    from zoff.models import meta_model
    from zoff.planning import disk_room

    model = meta_model(cfg.model)
    disk_room.check_swap_path(cfg, model)  # a real disk has the room
    monkeypatch.setattr(disk_room.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 4096))
    with pytest.raises(
        UserError, match=rf"nvme_path: {swap} has 4.0 KiB free; this node's swap files need .*B"
    ):
        disk_room.check_swap_path(cfg, model)
    (swap / "f").touch()
    a_file = config_from_dict(tiny_cfg(zero={"stage": 2, "offload_optimizer": _offload("nvme", swap / "f")}))
    with pytest.raises(UserError, match="is not a folder"):
        disk_room.check_swap_path(a_file, model)


def test_the_estimates_nvme_row_is_what_a_run_measures(swap: Path) -> None:
    """`zoff estimate`'s RAM and disk bytes for an NVMe policy against an engine's memory_report (the
    swap file as allocated, the unit buffers as mapped)."""
    from zoff.planning import memory

    cfg = config_from_dict(
        tiny_cfg(zero={"stage": 2, "reduce_bucket_size": 3000, "offload_optimizer": _offload("nvme", swap)})
    )
    row = memory.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 1, 1, "cpu").get(memory.Policy(2, "nvme"))
    torch.manual_seed(0)
    eng = build_engine(
        memory.meta_model(cfg.model), cfg.zero, cfg.optim, grad_clip=cfg.train.grad_clip, grad_accum=2
    )
    mem = eng.memory_report()
    assert row.disk == mem["disk_optimizer_states"] + mem["disk_grads"]
    # (speculate auto: the second slots beside the swap file, as the estimate's row counts them; their file is
    # made at the first speculated step, so none yet)
    states = eng.optimizer.states
    assert states.spec_file is None
    assert mem["disk_optimizer_states"] == sum(f.nbytes for f in states.files) + eng.second.state_bytes
    assert row.speculation.second.disk_bytes == eng.second.disk_bytes > 0
    assert row.disk_grads == mem["disk_grads"] == eng.grads.file.nbytes  # the gradient shard, on disk too
    assert row.cpu["grads"] == mem["cpu_grads"] == sum(b.nbytes for b in eng.grads.buffers)
    assert (
        row.cpu["optimizer_states"]
        == mem["cpu_optimizer_states"]
        == sum(b.nbytes for b in eng.optimizer.states.buffers)
    )
    eng.close()


@pytest.mark.parametrize("micro", [1, 2])
def test_the_estimates_disk_traffic_is_what_a_step_reads_and_writes(micro: int, swap: Path) -> None:
    """zero3-nvme: the estimate's swap files and bytes read and written per step against the I/O counters of
    a real step (optimizer states once each way; parameter shards per gather and after the step)."""
    from zoff.planning import memory

    zero = {"stage": 3, "reduce_bucket_size": 3000, "param_persistence_threshold": 64,
            "offload_optimizer": _offload("nvme", swap), "offload_param": {"device": "nvme"}}  # fmt: skip
    cfg = config_from_dict(tiny_cfg(zero=zero, train={"grad_accum": micro}))
    row = memory.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 1, 1, "cpu").get(
        memory.Policy(3, "nvme", "nvme")
    )
    torch.manual_seed(0)
    eng = build_engine(memory.meta_model(cfg.model), cfg.zero, cfg.optim, grad_clip=0.5, grad_accum=micro)
    # the gradient swap file too, and speculate auto's second slots (the states' second file, the parameter
    # file's second regions: a part of param_disk's file)
    files = (*eng.optimizer.states.files, eng.param_disk.file, eng.grads.file)
    # (the second slots' space is claimed at the first speculated step: under auto, clipping here, never)
    assert eng.optimizer.states.spec_file is None
    assert row.disk == sum(f.nbytes for f in files) + eng.second.disk_bytes
    x = torch.randint(0, 256, (2, 16))
    for _step in range(2):  # the second step is the steady state (the first records the gather order)
        r0, w0 = sum(f.read_bytes for f in files), sum(f.written_bytes for f in files)
        eng.zero_grad()
        for m in range(micro):
            eng.backward(eng.model(x).float().logsumexp(-1).mean(), sync=m == micro - 1)
        eng.step(1e-3)
    read, written = sum(f.read_bytes for f in files) - r0, sum(f.written_bytes for f in files) - w0
    assert abs(read - row.disk_read) <= 0.05 * row.disk_read, (read, row.disk_read)
    assert written == row.disk_written
    # the step reports the same bytes (metrics.jsonl carries last_step_times), and its time blocked on them
    t = eng.last_step_times
    assert t["disk_optimizer_read_bytes"] + t["disk_params_read_bytes"] + t["disk_grads_read_bytes"] == read
    assert (
        t["disk_optimizer_written_bytes"] + t["disk_params_written_bytes"] + t["disk_grads_written_bytes"]
        == written
    )
    assert t["disk_params_wait_s"] >= t["disk_params_read_wait_s"] >= 0 and t["disk_optimizer_wait_s"] >= 0
    eng.close()


def test_a_stale_swap_file_is_reclaimed_not_reused(swap: Path) -> None:
    """A killed run leaves its swap file behind; the next run truncates it and starts from the live
    parameters (results equal to CPU offload), never reading what was there."""
    stale = swap / "rank0" / "optimizer.swap"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\x7f" * (8 << 20))  # NaN-ish junk where the states would be read from
    want_losses, want, _ = _engine_run(2, "fp32", "cpu", swap)
    losses, got, eng = _engine_run(2, "fp32", "nvme", swap)
    assert losses == want_losses and all(torch.equal(got[k], v) for k, v in want.items())
    assert stale.stat().st_size == eng.optimizer.states.file.nbytes  # rewritten at this run's size
    eng.close()


def test_bench_io_measures_a_path_and_suggests_a_setting(swap: Path, tmp_path: Path) -> None:
    env = {**os.environ, "ZOFF_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "bench-io", str(swap), "--size", "8MiB"], capture_output=True, text=True,
        timeout=300, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith(f"zoff bench-io {swap} (")
    assert sum("raw O_DIRECT" in line and "GB/s" in line for line in lines) == 5
    assert any("engine swap" in line for line in lines)
    assert lines[-2].startswith("suggested: zero.offload_optimizer.io.threads=")
    assert lines[-1].endswith(str(tmp_path / "cache" / "bench-io.json"))
    assert list(swap.iterdir()) == []  # its files are gone
    # estimate projects the disk time per step from that measurement (any path on the same filesystem)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny_cfg(zero={"stage": 3, "offload_optimizer": _offload("nvme", swap)})))
    est = subprocess.run(
        [sys.executable, "-m", "zoff", "estimate", str(cfg), "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert est.returncode == 0, est.stderr
    out = json.loads(est.stdout)
    bw = out["disk_bandwidth"]
    assert bw["source"].startswith(f"zoff bench-io {swap}, ") and bw["read_gbps"] > 0
    row = next(r for r in out["policies"] if r["name"] == "zero3-nvme" and not r["activation_checkpointing"])
    per_rank = 1 / out["gpus_per_node"]
    want = per_rank * (row["disk_read_bytes_per_step_per_node"] / bw["read_gbps"]
                       + row["disk_written_bytes_per_step_per_node"] / bw["write_gbps"]) / 1e9  # fmt: skip
    assert row["disk_seconds_per_step"] == pytest.approx(want) and want > 0
    bad = subprocess.run(
        [sys.executable, "-m", "zoff", "bench-io", str(swap / "no")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.strip() == f"zoff: error: PATH: {swap / 'no'} is not a folder"


@pytest.mark.slow
@pytest.mark.grid  # (30 s; the default suite's restart-after-SIGKILL test is test_fault_tolerance's)
def test_sigkill_of_a_rank_on_an_nvme_run_resumes_by_itself_bit_identically(
    agents, swap: Path, tmp_path: Path
) -> None:
    """A worker killed mid-run (its swap file half written) restarts from the last checkpoint into fresh
    swap files and ends bit for bit where the uninterrupted NVMe run ends; no swap file is left behind."""
    from tests.processes import (
        RESTART_ENV,
        assert_bit_identical,
        events,
        final_tensors,
        last_step,
        losses,
        wait_for,
    )

    steps = 40
    cfg = lambda d: ("zero=zero2-nvme", f"zero.offload_optimizer.nvme_path={d}", "launch.threads_per_rank=1",  # noqa: E731
                     "train.log_every=1", f"train.max_steps={steps}", "checkpoint.every_steps=5")  # fmt: skip
    (swap / "ref").mkdir()
    (swap / "kill").mkdir()
    ref = agents(tmp_path / "ref", *cfg(swap / "ref")).ok()
    assert ref is not None
    run = tmp_path / "run"
    a = agents(run, *cfg(swap / "kill"), "--max-restarts", "1", env=RESTART_ENV)
    workers = a.wait_workers(2)
    wait_for(lambda: last_step(run) >= 12, "step 12", a)
    os.kill(workers[1], signal.SIGKILL)
    a.ok(failures=True)
    assert [e["restart"] for e in events(run, "resume")] == [1]  # it did die and come back
    assert losses(run) == losses(tmp_path / "ref")
    assert_bit_identical(final_tensors(run, steps), final_tensors(tmp_path / "ref", steps))
    assert list((swap / "kill").iterdir()) == [] and list((swap / "ref").iterdir()) == []


def test_zero_auto_turns_to_the_disk_when_host_memory_cannot_hold_the_states(swap: Path) -> None:
    """With an nvme_path that has room, `zero: auto` picks the disk tier once even CPU offload does not fit
    the host; without one, it reports that nothing fits."""
    from zoff.planning import choice, memory

    zero = {
        "stage": 2,
        "reduce_bucket_size": 200_000,
        "offload_optimizer": {**_offload("nvme", swap), "staging_mb": 1},
    }
    model = {"n_layer": 4, "n_head": 4, "d_model": 256}  # 3M params: states 18 MB per rank, 2.4 MB units
    cfg = config_from_dict(tiny_cfg(zero=zero, model=model))
    est = memory.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 2, 1, "cuda")
    offload = est.get(memory.Policy(2, "cpu"))
    nvme = est.get(memory.Policy(2, "nvme"))
    gpu = nvme.gpu_bytes  # the GPUs hold ZeRO-2's parameters but not ZeRO-3's optimizer states
    cpu = nvme.cpu_bytes_per_node + 1
    assert offload.cpu_bytes_per_node > cpu  # so host memory holds the disk tier's RAM, not CPU offload's
    got = choice.resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, 2, gpu, cpu, device_type="cuda")
    assert got[1] == "nvme" and "disk for swap files" in got[4]
    no_path = config_from_dict(tiny_cfg(zero={**zero, "offload_optimizer": {"staging_mb": 1}}, model=model))
    with pytest.raises(UserError, match="zero: auto: no policy fits"):
        choice.resolve_auto(
            no_path.model, no_path.data, no_path.train, no_path.zero, 2, gpu, cpu, device_type="cuda"
        )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_units_larger_than_a_subgroup_are_stepped_in_pieces(precision: str, swap: Path, monkeypatch) -> None:
    """A unit bigger than io.subgroup_mb is read, stepped, published and written back piece by piece (RAM is
    five pieces, not five units), with the same numbers as CPU offload."""
    import zoff.engine.zero as zero_mod

    want_losses, want, _ = _engine_run(2, precision, "cpu", swap, bucket=50_000)
    monkeypatch.setattr(zero_mod, "subgroup_of", lambda zero: 4096)  # io.subgroup_mb's floor is 1 MiB
    losses, got, eng = _engine_run(2, precision, "nvme", swap, bucket=50_000)
    states = eng.optimizer.states
    assert any(len(states.spans(i)) > 1 for i in range(len(eng.plan.units)))
    assert (
        sum(b.nbytes for b in states.buffers)
        == RING * 3 * 4 * 4096
        < 3 * 12 * max(u.shard for u in eng.plan.units)
    )
    assert losses == want_losses and all(torch.equal(got[k], v) for k, v in want.items())
    eng.close()
