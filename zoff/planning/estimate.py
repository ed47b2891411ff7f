"""`zoff estimate`: the memory table for every ZeRO policy on the given or detected hardware.

The numbers come from zoff.planning.memory (pure functions shared with `zero: auto` and the trainer's plan); this
module detects the hardware budget, runs the estimate (or --max-model's, --max-context's search) and prints it
(estimate_report.py), and resolves `zero: auto` (choose_policy).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from zoff.config import Config
from zoff.engine.disk.budget import mem_total
from zoff.errors import UserError
from zoff.planning.choice import resolve_auto, suggest_policy, suggest_split, with_sequence_parallel
from zoff.planning.estimate_report import DISK_AT_PATH, render, to_json
from zoff.planning.estimate_report import _step_json as _step_json  # (re-exported: tests read them here)
from zoff.planning.estimate_report import _timing_note as _timing_note
from zoff.planning.memory import Budget, Estimate, changes_config, estimate_to_fit
from zoff.planning.speculation_costs import swap_free_bytes
from zoff.units import parse_size as _parse_size

MIN_MEMORY, MAX_MEMORY = 2**26, 2**50  # 64 MiB .. 1 PiB: anything outside is a typo


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
    write: Path | None = None,
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
    sug = _suggestion(cfg, est, budget, gpn, n, device_type) if suggest else None
    if sug is not None:
        sug = (*sug, _command(config, overrides, cfg, sug, gpn, n, write))
    elif write is not None:
        raise UserError("--write: writes the suggested config; add --suggest")
    timing = step_timing(cfg, est, gpn, _seconds(compute_s)) if timed or compute_s is not None else None
    if as_json:
        print(json.dumps(to_json(est, budget, cfg.zero, cfg.train, sug, disk_source, timing), indent=2))
    else:
        render(est, budget, cfg.zero, cfg.train, sug, disk_source, timing)


def _suggestion(cfg: Config, est: Estimate, budget: Budget, gpn: int, nodes: int, device_type: str):
    """--suggest: (the fastest row that fits, the reason, train.sequence_parallel); where none fits at the
    configured N, the smallest larger N that makes one fit (choice.suggest_split) names itself in the reason."""
    pe, reason = suggest_policy(est, budget)
    if pe is None:
        found = suggest_split(cfg.model, cfg.data, cfg.train, cfg.zero, gpn, nodes, device_type, budget)
        if found is not None:
            return found
    return pe, reason, cfg.train.sequence_parallel


def _command(config: Path, overrides: list[str], cfg: Config, sug, gpn: int, nodes: int, write: Path | None):
    """The suggested row's `zoff train` line (None where no row fits); with `write`, that config resolved into
    the YAML file `write` (never overwritten), and the line trains that file."""
    from zoff.planning.suggest_command import suggested_command, suggested_overrides

    pe, _, n = sug
    if pe is None:
        return None
    extra = suggested_overrides(cfg, pe, n)
    if write is None:
        return suggested_command(config, overrides, cfg, extra, gpn, nodes)
    from zoff.config import dump_yaml, load_config

    resolved = load_config(config, [*overrides, *extra])
    line = suggested_command(write, [], resolved, [], gpn, nodes)
    head = f"# zoff estimate --suggest's row for {config} {' '.join(overrides)}".rstrip()
    try:
        with open(write, "x") as f:  # ("x": never overwrites)
            f.write(f"{head}\n# train it: {line}\n{dump_yaml(resolved)}")
    except FileExistsError:
        raise UserError(f"--write: {write} already exists (choose another file)") from None
    except OSError as e:
        raise UserError(f"--write: cannot write {write}: {e.strerror}") from None
    return line


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
    gbs, data_ranks = cfg.train.global_batch_size, est.world_size // est.sequence_parallel
    micro = cfg.train.grad_accum if gbs is None else max(1, gbs // (cfg.data.batch_size * data_ranks))
    shared = not torch.cuda.is_available()  # a CPU-only host: compute and the CPU Adam share the cores
    overlap, delayed = cfg.zero.offload_optimizer.overlap_step, cfg.zero.offload_optimizer.delay_update
    steps = step_time.predict_all(est, rates, pieces, shard, micro, overlap, shared, delayed)
    ac = cfg.train.activation_checkpointing
    return rates, {p: st for p, st in steps.items() if p.activation_checkpointing == ac}


def choose_policy(cfg: Config) -> tuple[Config, str]:
    """`zero: auto`: the config with the fastest policy that fits this hardware (the same arithmetic as
    `zoff estimate`), and the line that says what was chosen and why."""
    stage, opt_dev, param_dev, ckpt, reason, changes, n, offload = _resolve_auto(cfg)
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
    if n != cfg.train.sequence_parallel:  # (the global batch kept, as the reason says)
        train = with_sequence_parallel(train, cfg.data, n, cfg.launch.min_world)
    switched = offload and not cfg.train.activation_offload
    why = (
        f"zoff: zero: auto chose stage {stage}, offload optimizer {opt_dev}, params {param_dev}"
        f"{', activation checkpointing' if ckpt else ''}"
        f"{' with its inputs in host memory (train.activation_offload: nothing fits without)' if switched else ''}"
        f"{f', train.sequence_parallel {n}' if n != cfg.train.sequence_parallel else ''}"
        f": {reason}"
    )
    return dataclasses.replace(cfg, zero=zero, train=train), why


def _resolve_auto(cfg: Config) -> tuple[int, str, str, bool, str, dict, int, bool]:
    """resolve_auto's answer for this hardware and whether it keeps the checkpointed blocks' inputs in host
    memory. Tried in turn until one fits: the config as it is; on a GPU, with the inputs in host memory, which
    changes no result (bit for bit); then with each sequence split over more GPUs (train.sequence_parallel, the
    smallest N that fits: results equal within rounding), without and with the inputs offloaded. The tiles
    change the order of some sums, so they stay the user's choice. Where nothing fits, the first error."""
    budget, device_type = detect_budget(None, None)
    offload = cfg.train.activation_offload
    trains = [(cfg.train, offload)]
    if not offload and device_type == "cuda":  # (on a CPU-only host it moves bytes within the same memory)
        trains.append(
            (dataclasses.replace(cfg.train, activation_checkpointing=True, activation_offload=True), True)
        )
    first = None
    for split in (False, True) if cfg.launch.min_world > 1 else (False,):  # (one GPU: no N to try)
        for train, offloaded in trains:
            try:
                return (*resolve_auto(
                    cfg.model, cfg.data, train, cfg.zero, cfg.launch.min_world, budget.gpu, budget.cpu,
                    local_ranks=cfg.launch.nproc_per_node, shared=budget.shared, device_type=device_type, split=split,
                ), offloaded)  # fmt: skip
            except UserError as nothing_fits:
                first = first or nothing_fits
    raise first
