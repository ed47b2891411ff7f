"""`zoff estimate`: the memory table for every ZeRO policy on the given or detected hardware.

The numbers come from zoff.planning.memory (pure functions shared with `zero: auto` and the trainer's plan); this
module detects the hardware budget and prints the table or JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

from zoff.config import Config, TrainConfig, ZeroConfig
from zoff.engine.disk.budget import mem_total
from zoff.errors import UserError
from zoff.planning.bench_io import disk_bandwidth
from zoff.planning.choice import policy_label, resolve_auto, suggest_policy
from zoff.planning.memory import (
    GPU_KEYS,
    Budget,
    Estimate,
    Policy,
    PolicyEstimate,
    changes_config,
    changes_text,
    estimate_to_fit,
)
from zoff.planning.speculation_costs import spending_json, spending_notes, swap_free_bytes
from zoff.units import human
from zoff.units import parse_size as _parse_size

MIN_MEMORY, MAX_MEMORY = 2**26, 2**50  # 64 MiB .. 1 PiB: anything outside is a typo
DISK_AT_PATH = "free at zero.offload_optimizer.nvme_path"  # where Budget.disk comes from without --disk


def parse_size(text: str, flag: str) -> int:
    """A memory size flag's value in bytes (64 MiB to 1 PiB)."""
    return _parse_size(text, flag, MIN_MEMORY, MAX_MEMORY)


def parse_count(text: str | None, flag: str, hi: int) -> int | None:
    """A count flag's value (None when not given); a UserError naming `flag` unless it is 1..hi."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*\d+\s*", str(text)) or not 1 <= int(text) <= hi:
        raise UserError(f"{flag}: expected a whole number from 1 to {hi}, got '{text}'")
    return int(text)


def host_memory() -> int:
    """MemTotal from /proc/meminfo."""
    return mem_total()


def detect_budget(gpu_memory: str | None, cpu_memory: str | None) -> tuple[Budget, str]:
    """Given sizes win; else the first CUDA device and MemTotal. Without CUDA the "GPU" is the host itself."""
    if cpu_memory is not None:
        cpu, cpu_src = parse_size(cpu_memory, "--cpu-memory"), "--cpu-memory"
    else:
        cpu, cpu_src = host_memory(), "MemTotal of this host"
    if gpu_memory is not None:
        return Budget(parse_size(gpu_memory, "--gpu-memory"), cpu, False, "--gpu-memory", cpu_src), "cuda"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Budget(props.total_memory, cpu, False, f"detected {props.name}", cpu_src), "cuda"
    src = "no CUDA device: the ranks run on the CPU and share the host's memory with the offloaded states"
    return Budget(cpu, cpu, True, src, cpu_src), "cpu"


# ---------------------------------------------------------------------------------------------- output


def _is_configured(p: Policy, zero: ZeroConfig, train: TrainConfig) -> bool:
    return (p.stage, p.offload_optimizer, p.offload_param, p.activation_checkpointing) == (
        zero.stage, zero.offload_optimizer.device, zero.offload_param.device, train.activation_checkpointing,
    )  # fmt: skip


def to_json(
    est: Estimate,
    budget: Budget,
    zero: ZeroConfig,
    train: TrainConfig,
    suggestion=None,
    disk_source: str = DISK_AT_PATH,
    timing=None,
) -> dict:
    """`zoff estimate --json`; `timing`: (Rates, {policy: StepTime}) from step_time.py under --time."""
    bandwidth = disk_bandwidth(zero.offload_optimizer.nvme_path)
    steps = timing[1] if timing else {}
    out = {
        "params": est.params,
        "trainable_params": est.trainable_params,
        "world_size": est.world_size,
        "gpus_per_node": est.gpus_per_node,
        "nodes": est.nodes,
        "precision": est.precision,
        "activations_method": est.activation_method,
        "memory": {"gpu_bytes": budget.gpu, "cpu_bytes": budget.cpu, "shared": budget.shared,
                   "gpu_source": budget.gpu_source, "cpu_source": budget.cpu_source,
                   "disk_bytes": budget.disk, "disk_source": disk_source},
        "startup": dict(est.startup),
        "notes": list(est.notes),
        "policies": [
            {**pe.policy.to_dict(), "name": pe.policy.name, "gpu_bytes": pe.gpu_bytes,
             "cpu_bytes_per_node": pe.cpu_bytes_per_node, "gpu": dict(pe.gpu), "cpu": dict(pe.cpu),
             # the gradient shard where it lives: the GPU (no offload), host memory or the disk tier's file
             "grads": {"gpu_bytes": pe.gpu["grads"], "cpu_bytes_per_node": pe.cpu["grads"],
                       "disk_bytes_per_node": pe.disk_grads * pe.local_ranks},
             "pinned_bytes_per_node": pe.pinned * pe.local_ranks, "disk_bytes_per_node": pe.disk * pe.local_ranks,
             # optimizer states once each way; parameter shards per gather and after the step (disk_traffic)
             "disk_read_bytes_per_step_per_node": pe.disk_read * pe.local_ranks,
             "disk_written_bytes_per_step_per_node": pe.disk_written * pe.local_ranks,
             "disk_seconds_per_step": _disk_seconds(pe, bandwidth),
             # the disk tier's host budget (zero.offload_optimizer.host_budget): what stays in RAM, per rank
             "host_budget": {"budget_bytes": pe.split.budget, "resident_pieces": pe.split.resident_pieces,
                             "pieces": pe.split.pieces, "resident_state_bytes": pe.split.resident_bytes,
                             "state_bytes": pe.split.states_bytes, "grads_on_disk": pe.split.grads_on_disk}
             if pe.policy.offload_optimizer == "nvme" else None,
             "speculation": spending_json(pe.speculation, pe.local_ranks),
             "step_time": _step_json(steps.get(pe.policy)),
             "fits": pe.fits(budget), "configured": _is_configured(pe.policy, zero, train),
             "zero_changes": changes_config(pe.zero_changes)}
            for pe in est.policies
        ],
    }  # fmt: skip
    out["disk_bandwidth"] = {"read_gbps": bandwidth[0], "write_gbps": bandwidth[1], "source": bandwidth[2]}
    if timing:
        r = timing[0]
        out["rates"] = {"compute_s_per_micro_batch": r.compute_s, "adam_s_per_param": r.adam_s_per_param,
                        "read_gbps": r.read_gbps, "write_gbps": r.write_gbps, "sources": list(r.sources)}  # fmt: skip
    if suggestion is not None:
        pe, reason = suggestion
        out["suggestion"] = {**(pe.policy.to_dict() if pe else {}), "fits": pe is not None, "reason": reason}
    return out


def render(
    est: Estimate,
    budget: Budget,
    zero: ZeroConfig,
    train: TrainConfig,
    suggestion=None,
    disk_source: str = DISK_AT_PATH,
    timing=None,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 180)
    title = (
        f"{est.params:,} params ({est.trainable_params:,} trainable), {est.precision}, "
        f"{est.gpus_per_node} GPU(s) x {est.nodes} node(s) = world size {est.world_size}"
    )
    table = Table(title=title, title_justify="left")
    for col in ("policy", "act.ckpt", "params", "grads", "optim", "buffers", "activations", "GPU total",
                "CPU/node", "grads host", "pinned/node", "disk/node", "grads disk", "fits",
                *(["step s"] if timing else [])):  # fmt: skip
        table.add_column(col, justify="left" if col in ("policy", "act.ckpt") else "right", no_wrap=True)
    steps = timing[1] if timing else {}
    for pe in est.policies:
        configured = _is_configured(pe.policy, zero, train)
        fits = pe.fits(budget)
        g = pe.gpu
        table.add_row(
            ("▶ " if configured else "  ") + pe.policy.name + (" *" if pe.zero_changes else ""),
            "on" if pe.policy.activation_checkpointing else "off",
            *(human(g[k]) for k in GPU_KEYS), human(pe.gpu_bytes), human(pe.cpu_bytes_per_node),
            human(pe.cpu["grads"]) if pe.cpu["grads"] else "-",
            human(pe.pinned * pe.local_ranks), human(pe.disk * pe.local_ranks) if pe.disk else "-",
            human(pe.disk_grads * pe.local_ranks) if pe.disk_grads else "-",
            "yes" if fits else "no",
            *([f"{steps[pe.policy].step_s:,.1f}" if pe.policy in steps else "-"] if timing else []),
            style="bold" if configured else (None if fits else "dim"),
        )  # fmt: skip
    console.print(table)
    lines = [
        f"GPU memory: {human(budget.gpu)} ({budget.gpu_source}); CPU memory: {human(budget.cpu)} per node "
        f"({budget.cpu_source})",
        f"activations: {est.activation_method}, for the configured micro-batch; ▶ = the configured policy",
        "grads: the gradient shard per GPU where it lives: on the GPU without offload; under offload it leaves "
        "the GPU as each reduction finishes, into host memory (grads host, part of CPU/node) or, on nvme rows, "
        "a gradient swap file (grads disk, part of disk/node; zero.offload_optimizer.grad_device=cpu keeps it "
        "in RAM instead: less disk traffic, more RAM)",
        f"disk: {human(budget.disk)} ({disk_source})"
        if budget.disk
        else "disk: no disk tier (--disk SIZE or a zero.offload_optimizer.nvme_path folder offers one), so no "
        "nvme row fits",
        _startup_text(est, budget),
        *(f"note: {note}" for note in est.notes),
        *_disk_note(est, disk_bandwidth(zero.offload_optimizer.nvme_path)),
        *_budget_note(est),
        *spending_notes([(pe.policy.name, pe.speculation) for pe in _unrecomputed(est)]),
        *_parts_note(est),
        *(_timing_note(timing[0], steps) if timing else []),
        *([f"suggested: {suggestion[1]}"] if suggestion else []),
    ]
    for line in lines:
        console.print(line, soft_wrap=True)


def _parts_note(est: Estimate) -> list[str]:
    """The stage-3 rows that fit only with their layers gathered part by part (memory.fit_gathering)."""
    rows = [pe for pe in est.policies if pe.zero_changes]
    if not rows:
        return []
    which = "; ".join(f"{policy_label(pe.policy)}: {changes_text(pe.zero_changes)}" for pe in rows)
    return [f"*: does not fit as configured; with its layers gathered part by part it does: {which}"]


def _disk_seconds(pe: PolicyEstimate, bandwidth: tuple[float, float, str]) -> float:
    """A rank's disk time per step at the measured bandwidth, reads and writes one after the other (an upper
    bound: the engine overlaps them, and compute, where the disk serves both at once)."""
    return pe.disk_read / (bandwidth[0] * 1e9) + pe.disk_written / (bandwidth[1] * 1e9)


def _disk_note(est: Estimate, bandwidth: tuple[float, float, str]) -> list[str]:
    """What the disk tier costs: time per step at the disk's bandwidth, and the bytes written a day (SSD wear)."""
    worst = max(est.policies, key=lambda pe: pe.disk_written)
    if not worst.disk_written:
        return []
    read, written = (b * worst.local_ranks for b in (worst.disk_read, worst.disk_written))
    # the node's ranks share one disk: their traffic adds up
    seconds = _disk_seconds(worst, bandwidth) * worst.local_ranks
    per_day = written * 86400 / seconds
    return [
        f"nvme rows: each step reads the node's swap files for the optimizer (and, with parameters on disk, "
        f"for every gather) and writes them back: {human(read)} read and {human(written)} written per node per "
        f"step at the most ({worst.policy.name}), {seconds:,.1f} s of disk time per step at {bandwidth[0]:.2f} "
        f"GB/s read and {bandwidth[1]:.2f} GB/s write ({bandwidth[2]}); stepping that fast writes "
        f"{per_day / 1e12:,.1f} TB per node per day (SSD wear: check the drive's rated TBW)"
    ]


def _step_json(st) -> dict | None:
    """A row's StepTime; `speculated`: its step when the clip does not trigger (None: it does not speculate)."""
    if st is None:
        return None
    return {"forward_backward_s": st.forward_backward_s, "optimizer_s": st.optimizer_s, "step_s": st.step_s,
            "bound": st.bound, "speculated": _step_json(st.speculated)}  # fmt: skip


def _timing_note(rates, steps: dict) -> list[str]:
    lines = [
        f"step s (--time): forward and backward at {rates.compute_s:.2f} s per micro-batch, overlapping the "
        f"disk tier's parameter reads and gradient writes; then the CPU Adam overlapping the step's disk I/O "
        f"(offload rows with the configured activation checkpointing; {'; '.join(rates.sources)})"
    ]
    # (a line, not a second figure in the step s column: the table is already at its width)
    speculated = [f"{p.name} {st.speculated.step_s:,.1f} s (backward {st.speculated.forward_backward_s:,.1f} s, "
                  f"then {st.speculated.optimizer_s:,.1f} s)" for p, st in steps.items() if st.speculated]  # fmt: skip
    if speculated:
        lines.append(
            "step s on the rows that speculate (zero.offload_optimizer.speculate) is the step when the clip "
            "triggers (nothing committed: the walk steps every unit); when the clip does not trigger (every "
            "speculated unit committed: their states, gradients and new shards move on the disk and their CPU "
            "Adam runs during the last backward, on backward's own cores on a CPU-only host; only the rest walks "
            f"after it): {'; '.join(speculated)}"
        )
    return lines


def _unrecomputed(est: Estimate) -> list[PolicyEstimate]:
    """The rows without activation checkpointing: the notes' (a row with it has the same split and costs)."""
    return [pe for pe in est.policies if not pe.policy.activation_checkpointing]


def _budget_note(est: Estimate) -> list[str]:
    """The disk tier's host budget on the nvme rows (zero.offload_optimizer.host_budget): the same split for
    every row of one stage's plan, so one line per distinct split."""
    lines: dict[str, list[str]] = {}
    for pe in _unrecomputed(est):
        if pe.policy.offload_optimizer == "nvme":
            lines.setdefault(pe.split.describe(), []).append(pe.policy.name)
    return [f"{', '.join(names)}: {text}" for text, names in lines.items()]


def _startup_text(est: Estimate, budget: Budget) -> str:
    cpu, gpu = est.startup["cpu_bytes_per_node"], est.startup["gpu_bytes"]
    over = cpu > budget.cpu or (gpu > budget.gpu and not budget.shared)
    if not cpu:
        return (
            "start-up: the model is built on the meta device and materialised shard by shard (no whole copy)"
        )
    return (
        f"start-up: the trainer builds the full fp32 model on each rank's host ({human(cpu)} per node)"
        + (f" and moves it to the device ({human(gpu)} per GPU)" if gpu else "")
        + " before sharding it"
        + (": more than this hardware has, whatever the policy" if over else "")
    )


def run_cli(
    config: Path,
    overrides: list[str],
    gpus_per_node: str | None,
    nodes: str | None,
    gpu_memory: str | None,
    cpu_memory: str | None,
    as_json: bool,
    suggest: bool,
    max_model: bool = False,
    disk: str | None = None,
    timed: bool = False,
    compute_s: str | None = None,
    max_context: bool = False,
) -> None:
    """`zoff estimate`: flags are checked before the config is read so a typo fails fast.

    max_model: instead of the config's model, the largest of a ladder of GPT shapes each policy fits
    (zoff.planning.capacity); max_context: per policy, the longest context the config's model fits
    (zoff.planning.context). disk: the disk tier's size per node (default: the free space at
    zero.offload_optimizer.nvme_path when that folder exists, else none)."""
    from zoff.config import load_config

    for flag, on in (("--max-model", max_model), ("--max-context", max_context)):
        if on and (suggest or (max_model and max_context)):
            other = "--suggest" if suggest else "--max-context"
            raise UserError(
                f"{flag}: cannot be combined with {other} (each table names every policy's answer)"
            )
    budget, device_type = detect_budget(gpu_memory, cpu_memory)
    gpn = parse_count(gpus_per_node, "--gpus-per-node", 1024)
    n = parse_count(nodes, "--nodes", 100_000)
    disk_bytes = None if disk is None else _parse_size(disk, "--disk", 0, MAX_MEMORY)  # 0: no disk tier
    cfg = load_config(config, overrides)
    # nvme rows fit where the disk has room
    disk_source = "--disk" if disk_bytes is not None else DISK_AT_PATH
    budget = dataclasses.replace(budget, disk=swap_free_bytes(cfg.zero) if disk_bytes is None else disk_bytes)
    gpn = gpn or cfg.launch.nproc_per_node
    n = n or cfg.launch.min_nodes
    if max_model:
        from zoff.planning import capacity

        cap = capacity.max_model(
            cfg.model, cfg.data, cfg.train, cfg.zero, budget, gpn, n, device_type, disk_source=disk_source
        )
        if as_json:
            print(json.dumps(capacity.to_json(cap), indent=2))
        else:
            capacity.render(cap)
        return
    if max_context:
        from zoff.planning import context

        ctx = context.max_context(
            cfg.model, cfg.data, cfg.train, cfg.zero, budget, gpn, n, device_type, disk_source=disk_source
        )
        print(json.dumps(context.to_json(ctx), indent=2)) if as_json else context.render(ctx)
        return
    est = estimate_to_fit(cfg.model, cfg.data, cfg.train, cfg.zero, gpn, n, device_type, budget)
    sug = suggest_policy(est, budget) if suggest else None
    timing = step_timing(cfg, est, gpn, _seconds(compute_s)) if timed or compute_s is not None else None
    if as_json:
        print(json.dumps(to_json(est, budget, cfg.zero, cfg.train, sug, disk_source, timing), indent=2))
    else:
        render(est, budget, cfg.zero, cfg.train, sug, disk_source, timing)


def _seconds(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise UserError(f"--compute-s: expected seconds per micro-batch (a positive number), got '{text}'")
    return value


def step_timing(cfg: Config, est: Estimate, local_ranks: int, compute_s: float | None = None):
    """(Rates, {policy: StepTime}) for the offload rows with the configured activation checkpointing: the
    rates measured on this box (step_time.py), the bytes from the estimate."""
    from zoff.planning import step_time

    try:
        rates = step_time.measure_rates(cfg.model, cfg.data, cfg.train, cfg.zero, local_ranks, compute_s)
    except ValueError as e:
        raise UserError(f"--time: {e}") from None
    pieces, shard = step_time.plan_inputs(cfg.model, cfg.zero, est.world_size)
    gbs = cfg.train.global_batch_size
    micro = cfg.train.grad_accum if gbs is None else max(1, gbs // (cfg.data.batch_size * est.world_size))
    shared = not torch.cuda.is_available()  # a CPU-only host: compute and the CPU Adam share the cores
    overlap, delayed = cfg.zero.offload_optimizer.overlap_step, cfg.zero.offload_optimizer.delay_update
    steps = step_time.predict_all(est, rates, pieces, shard, micro, overlap, shared, delayed)
    ac = cfg.train.activation_checkpointing
    return rates, {p: st for p, st in steps.items() if p.activation_checkpointing == ac}


def choose_policy(cfg: Config) -> tuple[Config, str]:
    """`zero: auto`: the config with the fastest policy that fits this hardware (the same arithmetic as
    `zoff estimate`), and the line that says what was chosen and why."""
    budget, device_type = detect_budget(None, None)
    local = cfg.launch.nproc_per_node
    world = cfg.launch.min_world

    def resolve(train: TrainConfig) -> tuple[int, str, str, bool, str, dict]:
        return resolve_auto(
            cfg.model, cfg.data, train, cfg.zero, world, budget.gpu, budget.cpu,
            local_ranks=local, shared=budget.shared, device_type=device_type,
        )  # fmt: skip

    offload = cfg.train.activation_offload
    try:
        stage, opt_dev, param_dev, ckpt, reason, changes = resolve(cfg.train)
    except UserError as nothing_fits:
        # Nothing fits: with the checkpointed blocks' inputs in host memory, which changes no result (bit for
        # bit), something may. The tiles change the order of some sums, so they stay the user's choice.
        if offload or device_type != "cuda":  # (on a CPU-only host it moves bytes within the same memory)
            raise
        offloaded = dataclasses.replace(cfg.train, activation_checkpointing=True, activation_offload=True)
        try:
            stage, opt_dev, param_dev, ckpt, reason, changes = resolve(offloaded)
        except UserError:
            raise nothing_fits from None
        offload = True
    z = cfg.zero
    zero = dataclasses.replace(
        z, auto=False, recipe=None, stage=stage,
        offload_optimizer=dataclasses.replace(z.offload_optimizer, device=opt_dev),
        offload_param=dataclasses.replace(z.offload_param, device=param_dev),
    )  # fmt: skip
    zero = dataclasses.replace(zero, **changes_config(changes))
    train = dataclasses.replace(
        cfg.train, activation_checkpointing=ckpt or cfg.train.activation_checkpointing,
        activation_offload=offload,
    )  # fmt: skip
    switched = offload and not cfg.train.activation_offload
    why = (
        f"zoff: zero: auto chose stage {stage}, offload optimizer {opt_dev}, params {param_dev}"
        f"{', activation checkpointing' if ckpt else ''}"
        f"{' with its inputs in host memory (train.activation_offload: nothing fits without)' if switched else ''}"
        f": {reason}"
    )
    return dataclasses.replace(cfg, zero=zero, train=train), why
