"""The plan a run prints at start-up (and each rank logs): world, stage and compute dtype, the model-state
memory this rank's engine allocated against plain data parallelism's and the estimate's, host and disk bytes
where states are offloaded, what stage 3 gathers, and the batch."""

from __future__ import annotations

import torch

from zoff.data import GlobalBatches
from zoff.engine import ZeroEngine
from zoff.engine.disk.second_slots import second_buffer_bytes, speculation_ram_bytes
from zoff.engine.disk.traffic import held_write_back_bytes
from zoff.engine.footprint import data_parallel_bytes
from zoff.engine.speculation import speculates
from zoff.trainer.session import Session


def plan_lines(s: Session, threads: int) -> list[str]:
    """The start-up plan: what this rank's engine holds and where, its batches, and the notes of compiled
    blocks and of the 16-bit CPU kernels; rank 0 prints it, every rank logs it."""
    plan = _engine_lines(s.engine, s.batches, s.data_description, threads, s.upcast)
    if s.activation_offload is not None:
        plan.append("  " + s.activation_offload.describe())
    if s.compiled is not None:
        plan.append("  " + s.compiled.describe())
    if s.precision_note is not None:
        plan.append(s.precision_note)
    return plan


def _engine_lines(
    engine: ZeroEngine, batches: GlobalBatches, data_desc: str, threads: int, upcast: bool = False
) -> list[str]:
    mem = engine.memory_report()
    dtype = torch.get_default_dtype() if engine.dtype is None else engine.dtype
    # (train.cpu_precision=upcast: the states keep the engine's 16-bit dtype, the modules compute in fp32)
    compute = f"{dtype} states, torch.float32 compute" if upcast else f"{dtype} compute"
    gib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    plan = engine.plan
    shard = plan.shard_numel()
    return [
        f"zoff plan: world size {engine.comm.world} ({engine.comm.backend}), ZeRO stage {engine.stage}, "
        f"{compute}, "
        f"{threads} thread(s) per rank",
        f"  params {plan.numel:,} trainable in {len(plan.units)} unit(s){_frozen_text(engine)}; this rank's "
        f"shard {shard:,} elements",
        f"  model-state memory per rank: params {gib(mem['params'])}, grads {gib(mem['grads'])}, "
        f"optimizer {gib(mem['optimizer_states'])}",
        _vs_data_parallel(engine),
        *_unplanned(engine),
        *(
            [
                f"  host memory per rank (offload): params {gib(mem['cpu_params'])}, grads {gib(mem['cpu_grads'])}, "
                f"optimizer {gib(mem['cpu_optimizer_states'])}, staging {gib(mem['cpu_staging'])}"
                f"{_held_text(engine, gib)}; "
                f"page-locked {gib(engine.pinned_bytes())}" + _disk_text(mem, gib)
            ]
            if engine.offload
            else []
        ),
        *([f"  disk tier: {engine.split.describe()}"] if engine.policy.offload_optimizer == "nvme" else []),
        *_speculation_line(engine, gib),
        f"  batch: {batches.micro_batch} x {batches.grad_accum} accum x {_ranks(batches)} = "
        f"{batches.global_batch} sequences of {batches.seq_len} tokens{_shards(batches)}; data: {data_desc}",
    ] + _stage3_line(plan, engine.zero.block_classes)


def _ranks(batches: GlobalBatches) -> str:
    if batches.shards == 1:
        return f"{batches.data_world} ranks"
    return f"{batches.data_world} data ranks (x {batches.shards} sharing each sequence)"


def _shards(batches: GlobalBatches) -> str:
    """train.sequence_parallel: how much of each sequence a rank holds."""
    if batches.shards == 1:
        return ""
    return f", {batches.seq_len // batches.shards} tokens of each per rank (train.sequence_parallel {batches.shards})"


def _held_text(engine: ZeroEngine, gib) -> str:
    """The overlapped or delayed step's parameter write-backs: host buffers taken as the step runs, not at
    start-up (the estimate counts them in staging; the plan's staging figure is what is allocated now)."""
    held = held_write_back_bytes(engine.plan, engine.policy, engine.zero, engine.precision, engine.split)
    which = "delayed" if engine.zero.offload_optimizer.delay_update else "overlapped"
    return f" (+ up to {gib(held)} of held write-backs while the {which} step runs)" if held else ""


def _speculation_line(engine: ZeroEngine, gib) -> list[str]:
    """Whether the offloaded optimizer speculates (zero.offload_optimizer.speculate) and what that costs: the
    disk tier's second slots and RAM until commit, the host tier's second buffers; or why it does not."""
    if not engine.offload:
        return []
    oo, tier = engine.zero.offload_optimizer, engine.optimizer.tier.kind
    if oo.speculate is False or oo.delay_update:
        return [f"  speculation: off ({'speculate: false' if oo.speculate is False else 'delay_update'})"]
    if tier == "disk":  # (second_slots' line says why no unit is, where none is)
        ram = speculation_ram_bytes(
            engine.plan, engine.policy, engine.precision, engine.second, engine.split.grads_on_disk,
            engine.grad_accum > 1,
        )  # fmt: skip
        return [f"  {engine.second.describe()}" + (f"; {gib(ram)} of RAM until commit" if ram else "")]
    if engine.speculation is None:
        if not speculates(oo, engine.device, "cpu"):
            return ["  speculation: off (host tier on a host-only machine: auto leaves it off)"]
        return ["  speculation: off (the host budget leaves no room for a unit's second buffers)"]
    units = engine.speculation.units
    return [
        f"  speculation: second buffers for {len(units)} of {len(engine.plan.units)} unit(s)' optimizer states "
        f"(what the host budget leaves), {gib(second_buffer_bytes(engine.plan, units))} of RAM from the first "
        "speculated step"
    ]


def _frozen_text(engine: ZeroEngine) -> str:
    """The frozen parameters (a LoRA base, frozen layers) beside the trainable count, and the adapters' kind."""
    distinct = {id(p): p for p in engine.model.parameters() if not p.requires_grad}
    frozen = sum(p.numel() for p in distinct.values())
    lora = getattr(engine.model, "zoff_lora_config", None)
    adapters = f" (LoRA r {lora.r} on {', '.join(sorted(lora.target_modules))})" if lora is not None else ""
    return f"{adapters}, {frozen:,} frozen" if frozen else adapters


def _disk_text(mem: dict[str, int], fmt) -> str:
    parts = [
        f"{fmt(mem[k])} of {what}"
        for k, what in (
            ("disk_optimizer_states", "optimizer states"),
            ("disk_params", "parameter shards"),
            ("disk_grads", "gradient shards"),
        )  # fmt: skip
        if mem.get(k)
    ]
    return f"; disk {' and '.join(parts)}" if parts else ""


def model_state_bytes(engine: ZeroEngine) -> tuple[int, int]:
    """(this rank's device model-state bytes as allocated, what plain data parallelism would hold)."""
    mem = engine.memory_report()
    held = mem["params"] + mem["grads"] + mem["optimizer_states"] + mem["frozen_params"]
    return held, data_parallel_bytes(engine.plan.numel) + mem["frozen_params"]


def _vs_data_parallel(engine: ZeroEngine) -> str:
    held, ddp = model_state_bytes(engine)
    return (
        f"  = {held / 2**20:,.1f} MiB of model states on this rank's device (allocated), against "
        f"{ddp / 2**20:,.1f} MiB under plain data parallelism (DDP, 16 B/param): {ddp / max(held, 1):.1f}x less"
    )


def _unplanned(engine: ZeroEngine) -> list[str]:
    """A warning line where what the engine allocated differs from what the policy table (and so `zoff
    estimate`) predicts; tests/unit/test_planned_memory.py holds them equal for every policy."""
    mem, planned = engine.memory_report(), engine.planned_memory()
    mem = {**mem, "params": mem["params"] + mem["frozen_params"]}
    off = [f"{k} {mem[k]:,} allocated vs {v:,} planned" for k, v in planned.items() if mem.get(k, 0) != v]
    return [f"  warning: model states differ from the estimate: {'; '.join(off)}"] if off else []


def _stage3_line(plan, block_classes: list[str]) -> list[str]:
    """What stage 3 gathers at once: a model without repeated blocks is gathered whole (the root unit)."""
    blocks: dict[str, int] = {}
    for u in plan.all_units:
        if not u.persistent and u.modules:
            blocks[u.modules[0]] = blocks.get(u.modules[0], 0) + u.numel
    if not blocks:
        return []
    root = blocks.pop("", 0)
    largest = max(blocks.values(), default=0)
    chosen = f" (zero.block_classes: {', '.join(block_classes)})" if block_classes else ""
    if not blocks:
        return [f"  stage 3 gathers the whole model as one unit of {root:,} params{chosen}"]
    return [
        f"  stage 3 gathers {len(blocks)} block(s) one at a time (largest {largest:,} params) and a root "
        f"unit of {root:,} params kept from forward to the end of backward"
        + (f"; blocks follow zero.block_classes: {', '.join(block_classes)}" if block_classes else "")
    ]
