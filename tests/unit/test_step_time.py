"""`zoff estimate --time` (zoff/planning/step_time.py): the step model is the engine's schedule over the
estimate's own byte counts, and the CLI prints and writes it for the offload rows only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zoff.config import config_from_dict
from zoff.engine.disk.placement import DiskSplit
from zoff.engine.policy import Policy
from zoff.planning.memory import PolicyEstimate
from zoff.planning.step_time import Rates, predict

GB = 10**9


def _pe(policy: Policy, read: int, written: int, grads: int, split: DiskSplit) -> PolicyEstimate:
    return PolicyEstimate(policy, {}, {}, 1, 0, 0, read, written, grads, split)


def test_cpu_offload_is_compute_then_adam() -> None:
    rates = Rates(compute_s=2.0, adam_s_per_param=1e-9, read_gbps=1.0, write_gbps=2.0, sources=())
    st = predict(_pe(Policy(2, "cpu"), 0, 0, 0, DiskSplit()), [], rates, micro_batches=3, shard=10**9)
    assert (st.forward_backward_s, st.optimizer_s, st.step_s) == (6.0, 1.0, 7.0)
    assert st.bound == "compute / adam"


def test_the_disk_tier_splits_its_bytes_between_the_phases() -> None:
    """zero3-nvme: the step reads the streamed pieces and the gradient file and writes the pieces and the
    parameter shards back; forward and backward read the parameter shards and write the gradient file."""
    pieces = [4 * GB, 4 * GB, 2 * GB]  # the first stays in RAM
    split = DiskSplit(resident=(0,), pieces=3, grads_on_disk=True)
    streamed, grads, params = 6 * GB, 1 * GB, 1 * GB
    read = streamed + grads + 2 * params  # + each micro-batch's forward and backward reads
    written = (
        streamed + grads + params
    )  # the state write-backs, the gradient landing, the parameter write-back
    rates = Rates(compute_s=1.0, adam_s_per_param=1e-9, read_gbps=1.0, write_gbps=2.0, sources=())
    st = predict(_pe(Policy(3, "nvme", "nvme"), read, written, grads, split), pieces, rates, 1, 10**9)
    assert st.optimizer_s == pytest.approx((streamed + grads) / GB + (streamed + params) / (2 * GB))
    assert st.forward_backward_s == pytest.approx(2 * params / GB + grads / (2 * GB))  # disk-bound
    assert st.bound == "disk / disk"
    # a budget that holds every state leaves the step to the CPU Adam
    everything = DiskSplit(resident=(0, 1, 2), pieces=3, grads_on_disk=False)
    st = predict(_pe(Policy(3, "nvme", "nvme"), 2 * params, params, 0, everything), pieces, rates, 1, 10**9)
    assert st.optimizer_s == pytest.approx(max(1.0, params / (2 * GB)))


def test_the_overlapped_step_is_backward_then_the_walk_beside_one_forward() -> None:
    """overlap_step: backward (two thirds of the compute), then the longer of the walk's disk and the cores'
    work beside it: one forward plus the CPU Adam on shared cores, the longer of the two on a GPU host; with
    accumulation only one micro-batch's forward meets the walk."""
    pieces = [4 * GB, 4 * GB]
    split = DiskSplit(resident=(), pieces=2, grads_on_disk=True)
    streamed, grads, params = 8 * GB, 1 * GB, 1 * GB
    pe = _pe(
        Policy(3, "nvme", "nvme"), streamed + grads + 2 * params, streamed + grads + params, grads, split
    )
    walk_disk = (streamed + grads) / GB + (streamed + params) / (2 * GB)  # 9 + 4.5 s
    rates = Rates(compute_s=6.0, adam_s_per_param=1e-9, read_gbps=1.0, write_gbps=2.0, sources=())
    st = predict(pe, pieces, rates, 1, 10**9, overlap=True)
    assert (st.forward_backward_s, st.optimizer_s) == pytest.approx((4.0, walk_disk))  # disk-bound walk
    assert st.bound == "backward, then forward with the step: disk"
    serial = predict(pe, pieces, rates, 1, 10**9)
    assert serial.step_s - st.step_s == pytest.approx(2.0)  # the forward hides under the walk
    # slow cores: forward 10 s + Adam 4 s on shared cores, max(10, 4) with cores of their own
    slow = Rates(compute_s=30.0, adam_s_per_param=4e-9, read_gbps=1.0, write_gbps=2.0, sources=())
    assert predict(pe, pieces, slow, 1, 10**9, overlap=True).optimizer_s == pytest.approx(14.0)
    assert predict(pe, pieces, slow, 1, 10**9, overlap=True).forward_backward_s == pytest.approx(20.0)
    assert predict(pe, pieces, slow, 1, 10**9, True, shared_cores=False).optimizer_s == pytest.approx(
        walk_disk
    )
    # two micro-batches: only the next step's first forward meets the walk
    assert predict(pe, pieces, slow, 2, 10**9, overlap=True).forward_backward_s == pytest.approx(50.0)
    # stage 3 with the parameters in RAM (zero3-nvme-opt) overlaps the same way
    opt_only = _pe(Policy(3, "nvme", "cpu"), streamed + grads, streamed + grads, grads, split)
    assert predict(opt_only, pieces, rates, 1, 10**9, overlap=True).bound.startswith("backward, then forward")
    # every state in RAM (zero3-offload): the walk is the CPU Adam alone, beside the forward
    in_ram = _pe(Policy(3, "cpu", "cpu"), 0, 0, 0, DiskSplit())
    st = predict(in_ram, pieces, slow, 1, 10**9, overlap=True)
    assert (st.forward_backward_s, st.optimizer_s) == pytest.approx((20.0, 14.0))  # forward + Adam, shared
    gpu = predict(in_ram, pieces, slow, 1, 10**9, overlap=True, shared_cores=False)
    assert gpu.optimizer_s == pytest.approx(10.0)  # a GPU host: the longer of the forward and the Adam
    # stage 2 has no gathers to wait in: the flag changes nothing
    stage2 = _pe(Policy(2, "nvme", "none"), streamed + grads, streamed + grads, grads, split)
    assert predict(stage2, pieces, rates, 1, 10**9, overlap=True) == predict(stage2, pieces, rates, 1, 10**9)


def test_the_delayed_update_is_the_longer_of_the_cores_and_the_whole_disk() -> None:
    """delay_update: the walk runs beside the next forward and backward, so the step is the longer of the
    cores' work (compute and Adam one after the other on shared cores, the longer of the two on a GPU host)
    and every byte of the step at the disk's rates; with parameters in memory the masters' read-back (the
    new shards' file, disk_publish) follows the walk; the second gradient file is not read."""
    pieces = [4 * GB, 4 * GB]
    split = DiskSplit(resident=(), pieces=2, grads_on_disk=True)
    streamed, grads, params = 8 * GB, 1 * GB, 1 * GB
    pe = PolicyEstimate(
        Policy(3, "nvme", "nvme"), {}, {}, 1, 0, 0, streamed + grads + 2 * params, streamed + grads + params,
        2 * grads, split, grad_files=2,
    )  # fmt: skip
    disk = (streamed + grads + 2 * params) / GB + (streamed + grads + params) / (2 * GB)  # 11 + 5 s
    fast = Rates(compute_s=6.0, adam_s_per_param=1e-9, read_gbps=1.0, write_gbps=2.0, sources=())
    st = predict(pe, pieces, fast, 1, 10**9, delayed=True)
    assert (st.step_s, st.optimizer_s) == pytest.approx((disk, 0.0))
    assert st.bound == "delayed update beside forward and backward: disk"
    slow = Rates(compute_s=30.0, adam_s_per_param=4e-9, read_gbps=1.0, write_gbps=2.0, sources=())
    assert predict(pe, pieces, slow, 1, 10**9, delayed=True).step_s == pytest.approx(34.0)
    assert predict(pe, pieces, slow, 1, 10**9, shared_cores=False, delayed=True).step_s == pytest.approx(30.0)
    # parameters in memory: the walk writes the new shards to a file of their own, read back after it
    shards = 1 * GB
    opt_only = PolicyEstimate(
        Policy(3, "nvme", "cpu"), {}, {}, 1, 0, 0, streamed + grads + shards, streamed + grads + shards,
        2 * grads, split, grad_files=2, disk_publish=shards,
    )  # fmt: skip
    st = predict(opt_only, pieces, fast, 1, 10**9, delayed=True)
    assert st.optimizer_s == pytest.approx(shards / GB)
    assert st.forward_backward_s == pytest.approx(
        (streamed + grads) / GB + (streamed + grads + shards) / (2 * GB)
    )
    # the exact step's model is untouched by the second file: one file's bytes a step
    assert predict(pe, pieces, fast, 1, 10**9).optimizer_s == pytest.approx(
        (streamed + grads) / GB + (streamed + params) / (2 * GB)
    )


def test_zoff_estimate_time_prints_the_offload_rows_step(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: {n_layer: 2, n_head: 2, d_model: 32, seq_len: 16}\n"
        "data: {name: synthetic, seq_len: 16, batch_size: 2}\n"
        f"zero: {{stage: 2, offload_optimizer: {{device: nvme, nvme_path: {tmp_path}}}}}\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "estimate", str(cfg), "--json", "--compute-s", "0.5",
         "--gpus-per-node", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["rates"]["compute_s_per_micro_batch"] == 0.5 and out["rates"]["adam_s_per_param"] > 0
    rows = {(r["name"], r["activation_checkpointing"]): r for r in out["policies"]}
    assert rows[("zero2", False)]["step_time"] is None  # no offload: not modelled
    assert rows[("zero2-nvme", True)]["step_time"] is None  # not the configured activation checkpointing
    st = rows[("zero2-nvme", False)]["step_time"]
    assert st["forward_backward_s"] >= 0.5 and st["step_s"] == st["forward_backward_s"] + st["optimizer_s"]
    assert rows[("zero2-offload", False)]["step_time"]["forward_backward_s"] == 0.5


def test_a_bad_compute_time_is_one_line_exit_2() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "estimate", "tiny", "--compute-s", "fast"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "zoff: error: --compute-s: expected seconds per micro-batch (a positive number), got 'fast'"
    ]


def test_the_probe_needs_the_builtin_gpt() -> None:
    from zoff.planning.step_time import probe_engine

    cfg = config_from_dict({"model": {"name": "python:tests.fixtures_models:tied_frozen"}})
    with pytest.raises(ValueError, match="builtin GPT only"):
        probe_engine(cfg.model, cfg.data, cfg.train, cfg.zero, 1)
