"""The disk tier's host budget (zero.offload_optimizer.host_budget, engine/disk/placement.py): the disk holds only
what RAM cannot. A split budget (some sub-groups in RAM, the rest streamed) gives the same bits as everything
on disk and as CPU offload; its RAM is what the plan and `zoff estimate` say; its disk bytes per step are the
streamed pieces' only; a run resumes bit for bit at another budget; a size below the working set is one line,
exit 2, before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.forked_zoff import zoff_run
from tests.harness import run_zoff, tiny_cfg
from tests.integration.test_nvme import _engine_run
from zoff.config import config_from_dict
from zoff.engine import build_engine
from zoff.engine.disk.budget import host_budget_bytes
from zoff.engine.disk.placement import (
    DiskSplit,
    disk_split,
    grad_buffer_bytes,
    piece_bytes,
    piece_ram,
    ring_size,
    spread_units,
    subgroup_of,
    unit_pieces,
)
from zoff.engine.disk.swapfile import aligned
from zoff.engine.disk.traffic import disk_traffic, held_write_back_bytes, master_served_units
from zoff.engine.policy import Policy
from zoff.errors import ConfigError, UserError
from zoff.planning import memory

LAYERS = 8  # more pieces than the ring's five, so that a budget can hold some and stream the rest
MODEL = {"n_layer": 8}


def _partial_budget(plan, zero, precision: str, accumulating: bool, half: bool = False) -> int:
    """The smallest budget (working set + whole pieces) that keeps some but not all pieces in RAM (`half`: at
    least half of them, so that whole units past the persistent ones are resident)."""
    sizes = piece_ram(plan, subgroup_of(zero))
    itemsize = 4 if accumulating else {"bf16": 2, "fp32": 4}[precision]
    need = ring_size(len(sizes)) * max(sizes) + grad_buffer_bytes(plan, itemsize)
    for k in range(len(sizes) // 2 if half else 1, len(sizes)):
        split = disk_split(plan, Policy.of(zero), zero, precision, accumulating, need + sum(sizes[:k]))
        if 0 < split.resident_pieces < split.pieces and split.grads_on_disk:
            return need + sum(sizes[:k])
    raise AssertionError("no budget keeps part of the states in RAM")


def _half_budget(swap: Path, stage: int, precision: str, params: str) -> tuple[int, DiskSplit]:
    """A budget that keeps some of the optimizer's pieces in RAM (with the working set beside them)."""
    _, _, eng = _engine_run(stage, precision, "nvme", swap / "probe", steps=0, params=params, layers=LAYERS)
    eng.close()
    return _partial_budget(eng.plan, eng.zero, precision, True, half=True), eng.split


@pytest.mark.parametrize(
    ("stage", "precision", "params"), [(2, "bf16", "none"), (3, "fp32", "nvme"), (3, "bf16", "nvme")]
)
def test_a_split_budget_gives_the_bits_of_all_on_disk_and_of_cpu_offload(
    stage: int, precision: str, params: str, swap: Path
) -> None:
    half, everything_on_disk = _half_budget(swap, stage, precision, params)
    assert everything_on_disk.resident_pieces == 0 and everything_on_disk.grads_on_disk
    want_losses, want, _ = _engine_run(stage, precision, "cpu", swap / "cpu", layers=LAYERS)
    for budget in ("min", f"{half}B", "auto"):
        losses, got, eng = _engine_run(
            stage, precision, "nvme", swap / budget, params=params, budget=budget, layers=LAYERS
        )
        split = eng.split
        if budget == f"{half}B":  # part in RAM, part on disk, gradients on disk
            assert 0 < split.resident_pieces < split.pieces and split.grads_on_disk, split
        if budget == "auto":  # this machine's RAM holds a tiny model's states and gradients
            assert split.all_resident and not split.grads_on_disk, split
        assert losses == want_losses, budget
        for name, p in want.items():
            assert torch.equal(got[name], p), (budget, name)
        # the RAM the tier holds is the plan's (the policy table, what `zoff estimate` prints)
        report, plan = eng.memory_report(), eng.planned_memory()
        assert {k: report[k] for k in plan} == plan, budget
        kept = eng.optimizer.states.kept
        assert report["cpu_optimizer_states"] == (kept.nbytes if kept else 0) + sum(
            b.nbytes for b in eng.optimizer.states.buffers
        )
        # the last step moved the streamed pieces' states once each way, the resident ones not at all
        t = eng.last_step_times
        sizes = piece_bytes(eng.plan, subgroup_of(eng.zero))
        streamed = sum(n for k, n in enumerate(sizes) if k not in split.resident)
        assert t["disk_optimizer_read_bytes"] == t["disk_optimizer_written_bytes"] == streamed, budget
        assert ("disk_grads_read_bytes" in t) == split.grads_on_disk
        if params == "nvme":  # units whose states are all in RAM gather from their masters: no parameter I/O
            served = master_served_units(eng.plan, eng.policy, subgroup_of(eng.zero), split, False)
            assert set(eng.param_disk.from_master) == served
            assert bool(served) == (budget != "min") and (eng.param_disk.cast_bytes > 0) == bool(served)
            itemsize = {"bf16": 2, "fp32": 4}[precision]
            on_disk = [u for u in eng.plan.units if not u.persistent and u.index not in served]
            assert t["disk_params_written_bytes"] == sum(aligned(itemsize * u.shard) for u in on_disk), budget
            assert t["disk_params_read_bytes"] == 2 * sum(
                aligned(itemsize * u.shard) * (1 if u.modules == ("",) else 2) for u in on_disk
            ), budget  # forward and backward, over the 2 micro-batches
        eng.close()


def test_the_estimate_shows_the_split_and_the_disk_bytes_it_leaves(swap: Path) -> None:
    """`zoff estimate`'s row for the disk tier: the same split as the engine, and per-step disk bytes of only
    what the budget leaves on disk; a budget that holds every state moves no optimizer byte."""
    zero = {"stage": 2, "reduce_bucket_size": 3000,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "io": {"threads": 2, "request_mb": 1}}}  # fmt: skip
    base = config_from_dict(tiny_cfg(zero=zero, model=MODEL), ["zero.offload_optimizer.host_budget=min"])
    plan = memory.engine_plan(memory.meta_model(base.model), 2, 1, base.zero)
    at_min = memory.estimate(base.model, base.data, base.train, base.zero, 1, 1, "cpu").get(Policy(2, "nvme"))
    # on a CPU host the budget holds the rank's "device" bytes too (parameters, buffers, activations)
    reserved = memory.host_reserved(at_min.gpu, at_min.cpu, "cpu")
    assert reserved >= sum(at_min.gpu.values()) > 0
    # speculate auto: the streamed units' new shards and the gradient read buffer, RAM the budget holds too
    # (at min every unit is streamed: the most it can be)
    spec = at_min.speculation.ram
    assert spec == at_min.cpu["speculation"] > 0
    part = f"{_partial_budget(plan, base.zero, 'fp32', True) + reserved + spec}B"
    rows = {}
    for budget in ("min", part, "auto"):
        cfg = config_from_dict(
            tiny_cfg(zero=zero, model=MODEL), [f"zero.offload_optimizer.host_budget={budget}"]
        )
        row = memory.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 1, 1, "cpu").get(Policy(2, "nvme"))
        assert memory.rank_split(cfg, 1, 1, "cpu") == row.split  # what zoff train hands the engine
        eng = build_engine(
            memory.meta_model(cfg.model), cfg.zero, cfg.optim, grad_clip=0.5, grad_accum=2,
            host_reserved=row.split.reserved,
        )  # fmt: skip
        assert row.split == eng.split, budget
        assert row.cpu["optimizer_states"] == eng.memory_report()["cpu_optimizer_states"]
        eng.close()
        rows[budget] = row
    # auto keeps every state in RAM: nothing streams, nothing is speculated
    assert rows["auto"].split.reserved == reserved and "speculation" not in rows["auto"].cpu
    assert rows[part].split.reserved == reserved + rows[part].speculation.ram
    assert 0 < rows[part].speculation.ram < spec  # (the resident units are not speculated)
    assert rows["min"].split.resident_pieces == 0
    assert 0 < rows[part].split.resident_pieces < rows[part].split.pieces
    assert rows["min"].disk_read > rows[part].disk_read > rows["auto"].disk_read == 0
    assert rows["auto"].disk_written == 0 and rows["auto"].disk_grads == 0  # nothing moves at all
    # the same arithmetic, from the policy functions: the 200KiB row reads the streamed pieces and the grads
    split = rows[part].split
    grads = rows[part].disk_grads
    assert (rows[part].disk_read, rows[part].disk_written) == disk_traffic(
        plan, Policy(2, "nvme"), subgroup_of(cfg.zero), "fp32", 2, grads, split
    )


def test_the_rank_s_other_host_memory_counts_against_the_budget(swap: Path) -> None:
    """host_reserved (on a CPU host the device working set) comes off the budget before the states: a budget
    that holds every state alone keeps fewer beside it, and one that holds only the working set beside it
    streams every state (no error: the size holds the tier's working set); the plan line says so."""
    cfg = config_from_dict(
        tiny_cfg(
            zero={
                "stage": 2,
                "reduce_bucket_size": 3000,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
            },
            model=MODEL,
        )
    )
    plan = memory.engine_plan(memory.meta_model(cfg.model), 2, 1, cfg.zero)
    sizes = piece_ram(plan, subgroup_of(cfg.zero))
    working = ring_size(len(sizes)) * max(sizes) + grad_buffer_bytes(plan, 4)
    budget = working + sum(sizes)  # every state, beside the working set
    split = disk_split(plan, Policy(2, "nvme"), cfg.zero, "fp32", True, budget)
    assert split.all_resident and split.reserved == 0
    fewer = disk_split(plan, Policy(2, "nvme"), cfg.zero, "fp32", True, budget, reserved=working)
    assert 0 < fewer.resident_pieces < split.resident_pieces and fewer.reserved == working
    none = disk_split(plan, Policy(2, "nvme"), cfg.zero, "fp32", True, working, reserved=10 * budget)
    assert none.resident_pieces == 0 and none.budget == working and none.grads_on_disk
    assert "counted against it" in none.describe()


def test_auto_is_the_host_less_its_margin_split_over_the_ranks() -> None:
    oo = config_from_dict({}).zero.offload_optimizer
    gib = 2**30
    assert host_budget_bytes(oo, 128 * gib, 1) == 112 * gib  # 12.5% kept
    assert host_budget_bytes(oo, 128 * gib, 4) == 28 * gib
    assert host_budget_bytes(oo, 8 * gib, 1) == 5 * gib + gib // 4  # at least 2 GiB + 0.75 GiB a rank kept
    assert host_budget_bytes(oo, 24 * gib, 8) == (24 - 8) * gib // 8  # 2 + 8 x 0.75 GiB > 12.5%
    oo_min = config_from_dict({}, ["zero.offload_optimizer.host_budget=min"]).zero.offload_optimizer
    assert host_budget_bytes(oo_min, 128 * gib, 1) is None
    sized = config_from_dict({}, ["zero.offload_optimizer.host_budget=3GiB"]).zero.offload_optimizer
    assert host_budget_bytes(sized, 128 * gib, 8) == 3 * gib  # a size is per rank, as given


def test_a_budget_that_is_not_a_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^zero\.offload_optimizer\.host_budget: cannot parse 'lots'"):
        config_from_dict({}, ["zero.offload_optimizer.host_budget=lots"])


def test_a_budget_below_the_working_set_names_both_sizes(swap: Path) -> None:
    cfg = config_from_dict(
        tiny_cfg(zero={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}}),
        ["zero.offload_optimizer.host_budget=4KiB"],
    )
    plan = memory.engine_plan(memory.meta_model(cfg.model), 2, 1, cfg.zero)
    with pytest.raises(
        UserError, match=r"^zero\.offload_optimizer\.host_budget: 4\.0 KiB per rank cannot hold"
    ):
        disk_split(plan, Policy(2, "nvme"), cfg.zero, "fp32", False, 4096)


def test_zoff_train_with_a_budget_too_small_fails_in_one_line_before_any_rank(
    swap: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    p = zoff_run(
        ["train", "tiny", "zero.stage=2", "zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={swap}",
         "zero.offload_optimizer.host_budget=64KiB", "launch.nproc_per_node=1", f"--run-dir={run}"],
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "zoff: error: zero.offload_optimizer.host_budget: 64.0 KiB per rank cannot hold the disk tier's working set"
    ), p.stderr
    assert not run.exists() and list(swap.iterdir()) == []  # nothing started, nothing written


def _resume_cfg(swap: Path, ckpt: Path, budget: str) -> dict:
    return tiny_cfg(
        zero={
            "stage": 2,
            "reduce_bucket_size": 3000,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(swap),
                "host_budget": budget,
                "io": {"threads": 2, "request_mb": 1},
            },
        },  # fmt: skip
        train={"max_steps": 8, "grad_accum": 2},
        model=MODEL,
        checkpoint={"dir": str(ckpt), "every_steps": 4, "keep_last": 3},
    )


def test_a_run_resumes_bit_for_bit_at_another_budget(swap: Path, tmp_path: Path) -> None:
    """Saved with half the states in RAM (synced into the checkpoint), resumed with everything on disk and
    with everything in RAM: both continue exactly as the run that never stopped."""
    probe = config_from_dict(_resume_cfg(swap, tmp_path, "min"))
    plan = memory.engine_plan(memory.meta_model(probe.model), 2, 2, probe.zero)
    budget = _partial_budget(plan, probe.zero, "fp32", True)
    budget = f"{budget}B"
    full = run_zoff(_resume_cfg(swap / "a", tmp_path / "a", budget), 2, tmp_path)[0]
    step4 = str(tmp_path / "a" / "step_00000004")
    for other in ("min", "auto"):
        again = run_zoff(_resume_cfg(swap / other, tmp_path / other, other), 2, tmp_path, step4)[0]
        assert again["start"] == 4 and again["losses"] == full["losses"][4:], other
        for name, p in full["params"].items():
            assert torch.equal(again["params"][name], p), (other, name)


def test_the_budget_keeps_whole_units_spread_over_the_walk() -> None:
    """Resident pieces are whole units (their gathers then cast the master: no parameter I/O), spread evenly
    over the walk (their CPU Adam runs while the disk reads the streamed ones ahead), and as many as the room
    holds, less at most one unit."""
    from zoff.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "gpt-3b-nvme.yaml", ["model.n_layer=4"])
    plan = memory.engine_plan(memory.meta_model(cfg.model), 3, 1, cfg.zero)
    room = 4 << 30
    split = disk_split(plan, Policy.of(cfg.zero), cfg.zero, "bf16", False, room)
    assert 0 < split.resident_pieces < split.pieces
    units = unit_pieces(plan, subgroup_of(cfg.zero))
    resident = set(split.resident)
    assert all(set(p) <= resident or not set(p) & resident for p in units)  # whole units only
    half = split.pieces // 2
    assert 0.3 < sum(k < half for k in resident) / len(resident) < 0.7  # in both halves of the walk
    served = master_served_units(plan, Policy.of(cfg.zero), subgroup_of(cfg.zero), split, False)
    assert served == {
        u.index for u, p in zip(plan.units, units) if p and set(p) <= resident and not u.persistent
    }
    assert master_served_units(plan, Policy.of(cfg.zero), subgroup_of(cfg.zero), split, True) == frozenset()
    # the overlapped step holds write-backs of streamed units only: none when every unit is resident
    everything = disk_split(plan, Policy.of(cfg.zero), cfg.zero, "bf16", False, 1 << 40)
    assert cfg.zero.offload_optimizer.overlap_step and everything.all_resident
    held = [held_write_back_bytes(plan, Policy.of(cfg.zero), cfg.zero, "bf16", s) for s in (None, everything)]
    assert held[0] > 0 and held[1] == 0
    # the arithmetic: a unit is kept while the kept bytes, with half of it, stay within the room's share
    ram = [10, 10, 10, 10, 10, 10, 10, 10]
    assert spread_units(ram, [range(k, k + 1) for k in range(8)], 40) == (0, 2, 4, 6)
    assert spread_units(ram, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)], 40) == (0, 1, 4, 5)
    assert spread_units(ram, [range(k, k + 1) for k in range(8)], 80) == tuple(range(8))
    assert spread_units(ram, [range(k, k + 1) for k in range(8)], 9) == ()
