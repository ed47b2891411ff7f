"""What exact speculation (zero.offload_optimizer.speculate) costs, counted (issue 53): `zoff estimate`'s disk and
RAM figures are what a speculating engine allocates (its swap files on disk, its kept shards, gradient read
buffer and second buffers at the peak of a step); the second slots take only the disk's room, last unit
first, and say so; the start-up plan says whether a run speculates and what it costs, or why not."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness import tiny_cfg
from zoff.config import config_from_dict
from zoff.engine import build_engine
from zoff.engine.disk.placement import disk_split, piece_bytes, subgroup_of, unit_pieces
from zoff.engine.disk.second_slots import SecondSlots, second_buffer_bytes, second_slots
from zoff.engine.disk.swapfile import aligned
from zoff.engine.policy import Policy, engine_plan
from zoff.models import build_for_engine, meta_model
from zoff.planning import estimate as E
from zoff.planning import memory
from zoff.planning.speculation_costs import swap_free_bytes
from zoff.trainer.plan_banner import _speculation_line
from zoff.units import human

REPO = Path(__file__).resolve().parents[2]
IO = {"threads": 2, "request_mb": 1}


def _cfg(swap: Path | None, stage: int = 2, opt: str = "nvme", par: str = "none", **oo):
    zero = {"stage": stage, "reduce_bucket_size": 3000, "param_persistence_threshold": 64,
            "offload_optimizer": {"device": opt, "nvme_path": str(swap) if swap else None, "io": IO,
                                  "host_budget": "min", **oo},
            "offload_param": {"device": par, "io": IO}}  # fmt: skip
    return config_from_dict(tiny_cfg(zero=zero, model={"n_layer": 4}, train={"grad_clip": 0.0}))


def _engine(cfg, host_reserved: int = 0):
    torch.manual_seed(0)
    return build_engine(
        build_for_engine(cfg.model), cfg.zero, cfg.optim, grad_clip=cfg.train.grad_clip,
        grad_accum=cfg.train.grad_accum, host_reserved=host_reserved,
    )  # fmt: skip


def _drained(spec) -> None:
    """Every unit whose gradient landed is speculated before the step stops the worker (which otherwise drops
    what is still queued): the peak the estimate counts, every speculated unit held at once."""
    stop = spec.stop

    def stop_drained(commit: bool):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (spec.seen & spec.units) - spec.tainted <= spec.done:
            time.sleep(0.002)
        return stop(commit)

    spec.stop = stop_drained


def _steps(eng, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        eng.zero_grad()
        for micro in range(2):
            x = torch.randint(0, 256, (2, 16), generator=gen)
            loss = eng.model(x).float().logsumexp(-1).mean() / 2
            eng.backward(loss, sync=micro == 1, lr=1e-3)
        eng.step(1e-3)


# ------------------------------------------------------------------------------------- the second slots
def test_the_second_slots_take_only_the_disks_room_last_unit_first() -> None:
    cfg = _cfg(Path("/nonexistent"), stage=3, par="nvme")
    plan = engine_plan(meta_model(cfg.model), 3, 1, cfg.zero)
    pol = Policy.of(cfg.zero)
    split = disk_split(plan, pol, cfg.zero, "fp32", True, None)  # min: every piece streamed
    full = second_slots(plan, pol, cfg.zero, "fp32", split, None)
    assert len(full.units) == full.candidates == len(plan.units) > 2
    assert "(the disk's room" not in full.describe()
    # a unit's second slots: its pieces' states once more, and its parameter shard's second region
    sizes, pieces = piece_bytes(plan, subgroup_of(cfg.zero)), unit_pieces(plan, subgroup_of(cfg.zero))
    cost = {u.index: sum(sizes[k] for k in ks) + (0 if u.persistent else aligned(4 * u.shard))
            for u, ks in zip(plan.units, pieces)}  # fmt: skip
    assert full.disk_bytes == sum(cost.values())
    last, before = plan.units[-1].index, plan.units[-2].index
    room = cost[last] + cost[before]
    two = second_slots(plan, pol, cfg.zero, "fp32", split, room)
    assert two.units == {last, before} and two.disk_bytes == room and two.room == room
    assert two.pieces == set(pieces[last]) | set(pieces[before])
    assert two.describe().startswith(f"speculation: second slots for 2 of {full.candidates} streamed units")
    assert f"(the disk's room, {human(room)}, holds only these)" in two.describe()
    one = second_slots(plan, pol, cfg.zero, "fp32", split, room - 1)  # (a smaller earlier unit may fit)
    assert last in one.units and before not in one.units and one.disk_bytes <= room - 1
    none = second_slots(plan, pol, cfg.zero, "fp32", split, 0)
    assert none == SecondSlots(candidates=full.candidates, room=0)
    assert "0 of" in none.describe() and "holds only these" in none.describe()


# ------------------------------------------------------------------------- estimate against the engine
@pytest.mark.parametrize(("stage", "par"), [(2, "none"), (3, "nvme")])
def test_the_estimate_counts_what_a_speculating_disk_tier_allocates(stage: int, par: str, swap: Path) -> None:
    """Stage 2 keeps every speculated unit's new shard in RAM until commit; stage 3 with parameters on disk
    only its persistent units' (the rest go to the parameter file's second regions). Both read each final
    gradient back from the gradient file into one buffer."""
    swap.mkdir(parents=True, exist_ok=True)
    cfg = _cfg(swap, stage, par=par, speculate=True)
    est = memory.estimate(
        cfg.model, cfg.data, cfg.train, cfg.zero, 1, 1, "cpu", disk_free=swap_free_bytes(cfg.zero)
    )
    row = est.get(Policy.of(cfg.zero))
    eng = _engine(cfg, row.split.reserved)
    try:
        assert eng.split == row.split
        # the same units, pieces and bytes (the room: the disk's free bytes a moment apart)
        assert dataclasses.replace(eng.second, room=None) == dataclasses.replace(
            row.speculation.second, room=None
        )
        assert eng.second.units and eng.second.room is not None
        # (the second slots' space is claimed at the first speculated step: nothing of it before)
        assert eng.optimizer.states.spec_file is None
        # RAM: the kept new shards at their peak, and the gradient read buffer
        kept, held = 0, eng.publication.second
        keep = eng.speculation.keep_piece

        def counted(u: int, lo: int, master: torch.Tensor) -> None:
            nonlocal kept
            keep(u, lo, master)
            kept = max(kept, sum(t.numel() * t.element_size() for ps in held.values() for _, t in ps))

        eng.speculation.keep_piece = counted
        _drained(eng.speculation)
        _steps(eng)
        assert eng.speculation.counts["committed_units"] > 0
        assert eng.speculation.last["committed"] == len(eng.second.units)  # every unit, held at once
        # disk: every swap file as made, the second slots' file and regions included
        files = [p for p in swap.rglob("*") if p.is_file()]
        assert row.disk == sum(p.stat().st_size for p in files)
        assert row.speculation.second.state_bytes == eng.optimizer.states.spec_file.nbytes
        if par == "nvme":
            assert row.speculation.second.param_bytes > 0
        assert kept > 0
        assert row.cpu["speculation"] == row.speculation.ram == kept + eng.speculation.buffer.nbytes
    finally:
        eng.close()


def test_the_estimate_counts_the_host_tiers_second_buffers() -> None:
    """The host tier's second buffers (12 B per element of the shard): what memory_report's optimizer
    states grow by at the first speculated step."""
    cfg = _cfg(None, 2, opt="cpu", speculate=True, host_budget="1GiB")
    row = memory.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 1, 1, "cpu").get(Policy(2, "cpu"))
    eng = _engine(cfg)
    try:
        before = eng.memory_report()["cpu_optimizer_states"]
        _drained(eng.speculation)
        _steps(eng, 1)
        grown = eng.memory_report()["cpu_optimizer_states"] - before
        assert eng.speculation.last["speculated"] == len(eng.plan.units)
        assert row.speculation.ram == grown == second_buffer_bytes(eng.plan)
        assert "speculation" not in row.cpu  # (what the budget leaves: not a need the CPU column adds)
        n = len(eng.plan.units)
        assert _speculation_line(eng, human) == [
            f"  speculation: second buffers for {n} of {n} unit(s)' optimizer states (what the host budget "
            f"leaves), {human(grown)} of RAM from the first speculated step"
        ]
    finally:
        eng.close()
    # the host budget min leaves no room: nothing speculated, nothing counted, and the plan says why
    tight = _cfg(None, 2, opt="cpu", speculate=True)
    eng = _engine(tight)
    try:
        assert eng.speculation is None
        assert _speculation_line(eng, human) == [
            "  speculation: off (the host budget leaves no room for a unit's second buffers)"
        ]
    finally:
        eng.close()
    row_min = memory.estimate(tight.model, tight.data, tight.train, tight.zero, 1, 1, "cpu").get(
        Policy(2, "cpu")
    )
    assert "speculation" not in row_min.cpu
    # auto on a host-only machine leaves the host tier alone: nothing counted; on a GPU it speculates
    auto = _cfg(None, 2, opt="cpu", host_budget="1GiB")
    on_cpu = memory.estimate(auto.model, auto.data, auto.train, auto.zero, 1, 1, "cpu").get(Policy(2, "cpu"))
    on_gpu = memory.estimate(auto.model, auto.data, auto.train, auto.zero, 1, 1, "cuda").get(Policy(2, "cpu"))
    assert "speculation" not in on_cpu.cpu and not on_cpu.speculation.on
    assert on_gpu.speculation.on and on_gpu.speculation.ram == row.speculation.ram


def test_zoff_estimate_prints_the_cost_and_a_short_disk(swap: Path, tmp_path: Path, capsys) -> None:
    """The speculation line as the split's is printed, per distinct cost; --disk a little over the swap files
    and the margin speculates only what that room holds, and fits as before."""
    import yaml

    swap.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "cfg.yaml"
    oo = {"device": "nvme", "nvme_path": str(swap), "host_budget": "min"}
    cfg_dict = tiny_cfg(
        zero={"stage": 2, "reduce_bucket_size": 3000, "offload_optimizer": oo}, model={"n_layer": 4}
    )
    config.write_text(yaml.safe_dump(cfg_dict))
    args = dict(gpus_per_node="1", nodes=None, gpu_memory=None, cpu_memory="64GiB", suggest=False)
    E.run_cli(config, [], as_json=True, **args)
    rows = {p["name"]: p for p in json.loads(capsys.readouterr().out)["policies"]}
    wide = rows["zero2-nvme"]["speculation"]
    assert wide["tier"] == "disk" and wide["units"] == wide["candidates"] > 1
    assert rows["zero2-offload"]["speculation"] is None  # host tier, host-only machine: auto leaves it off
    base = rows["zero2-nvme"]["disk_bytes_per_node"] - wide["second_slot_bytes_per_node"]
    short = base + (1 << 30) + wide["second_slot_bytes_per_node"] // 2  # room for about half the slots
    E.run_cli(config, [], as_json=True, disk=f"{short}B", **args)
    narrow = {p["name"]: p for p in json.loads(capsys.readouterr().out)["policies"]}["zero2-nvme"]
    assert 0 < narrow["speculation"]["units"] < wide["units"] and narrow["fits"]
    assert narrow["speculation"]["second_slot_bytes_per_node"] <= narrow["speculation"]["room_bytes"]
    E.run_cli(config, [], as_json=False, disk=f"{short}B", **args)
    out = capsys.readouterr().out
    line = next(
        ln for ln in out.splitlines() if ln.startswith("zero1-nvme, zero2-nvme") and ": speculation:" in ln
    )
    assert f"second slots for {narrow['speculation']['units']} of {wide['candidates']} streamed units" in line
    assert "holds only these" in line and "of RAM per rank until commit" in line


# ----------------------------------------------------------------------------------------- the plan
def test_the_plan_says_why_an_engine_does_not_speculate(swap: Path) -> None:
    swap.mkdir(parents=True, exist_ok=True)
    for cfg, why in (
        (_cfg(swap / "off", speculate=False), "speculate: false"),
        (_cfg(None, opt="cpu", delay_update=True), "delay_update"),
        (_cfg(None, opt="cpu"), "host tier on a host-only machine: auto leaves it off"),
    ):
        if cfg.zero.offload_optimizer.nvme_path:
            Path(cfg.zero.offload_optimizer.nvme_path).mkdir()
        eng = _engine(cfg)
        try:
            assert eng.speculation is None
            assert _speculation_line(eng, human) == [f"  speculation: off ({why})"]
        finally:
            eng.close()
    no_offload = _engine(config_from_dict(tiny_cfg(zero={"stage": 2})))
    assert _speculation_line(no_offload, human) == []  # (the optimizer on the device: nothing to speculate)
    no_offload.close()


@pytest.mark.slow
def test_zoff_train_prints_the_speculation_line(swap: Path, tmp_path: Path) -> None:
    import yaml

    swap.mkdir(parents=True, exist_ok=True)
    cfg = tiny_cfg(
        zero={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "host_budget": "min"}},
        train={"max_steps": 1, "eval_batches": 1, "grad_accum": 1},
        checkpoint={"enabled": False}, launch={"nproc_per_node": 1},
    )  # fmt: skip
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "train", str(config), "--run-dir", str(tmp_path / "run")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("  speculation:")]
    assert len(lines) == 1, p.stdout
    assert lines[0].startswith("  speculation: second slots for 1 of 1 streamed units"), lines
    assert lines[0].endswith("MiB of RAM until commit"), lines
