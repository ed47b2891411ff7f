"""`zoff estimate`'s output: the memory table and its notes (render) and the same numbers as JSON (to_json),
from an estimate zoff.planning.memory computed (zoff.planning.estimate detects the budget and runs it)."""

from __future__ import annotations

import sys

from zoff.config import TrainConfig, ZeroConfig
from zoff.planning.bench_io import disk_bandwidth
from zoff.planning.choice import policy_label
from zoff.planning.memory import (
    GPU_KEYS,
    Budget,
    Estimate,
    Policy,
    PolicyEstimate,
    changes_config,
    changes_text,
)
from zoff.planning.speculation_costs import spending_json, spending_notes
from zoff.units import human

DISK_AT_PATH = "free at zero.offload_optimizer.nvme_path"  # where Budget.disk comes from without --disk


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
        # ranks sharing each sequence (train.sequence_parallel): every byte here is one rank's, of seq / N tokens
        "sequence_parallel": est.sequence_parallel,
        "activations_method": est.activation_method,
        # the all-to-alls' moment within the activations, without and with checkpointing (0 at N = 1)
        "exchange_bytes": est.exchange,
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
        pe, reason, n, command = suggestion
        out["suggestion"] = {**(pe.policy.to_dict() if pe else {}), "fits": pe is not None, "reason": reason,
                             "sequence_parallel": n, "command": command}  # fmt: skip
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
        + (f", each sequence split over {est.sequence_parallel}" if est.sequence_parallel > 1 else "")
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
        *_sequence_note(est),
        *(f"note: {note}" for note in est.notes),
        *_disk_note(est, disk_bandwidth(zero.offload_optimizer.nvme_path)),
        *_budget_note(est),
        *spending_notes([(pe.policy.name, pe.speculation) for pe in _unrecomputed(est)]),
        *_parts_note(est),
        *(_timing_note(timing[0], steps) if timing else []),
        *([f"suggested: {suggestion[1]}"] if suggestion else []),
        *([f"run: {suggestion[3]}"] if suggestion and suggestion[3] else []),
    ]
    for line in lines:
        console.print(line, soft_wrap=True)


def _sequence_note(est: Estimate) -> list[str]:
    """train.sequence_parallel: what a rank holds, and the all-to-alls' part of the activations."""
    n = est.sequence_parallel
    if n == 1:
        return []
    return [
        f"sequence parallel: each GPU holds 1/{n} of every sequence's tokens (train.sequence_parallel {n}; "
        f"{est.world_size // n} data-parallel group(s)), attends over the whole sequence for 1/{n} of the heads "
        f"and shards the model states over all {est.world_size} GPUs; the all-to-all of a layer's q, k, v holds "
        f"{human(est.exchange)} of buffers at once (in the activations' peak)"
    ]


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
