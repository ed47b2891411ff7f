"""Before any rank starts, the disks a run will fill: the disk tier's swap folders, and the checkpoint folder.

A swap path without room fails at start-up anyway (the engine reserves its files); a checkpoint folder without
room would fail at the first save, hours in, with nothing saved. Both are checked by `zoff train` (and
`validate`) before a rank starts: one line naming the key, the path and both sizes, exit 2.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from torch import nn

from zoff.config import Config
from zoff.engine.disk.budget import host_budget_bytes, mem_total
from zoff.engine.disk.placement import (
    disk_split,
    grad_disk_bytes,
    next_params_bytes,
    optimizer_disk_bytes,
    param_disk_bytes,
    param_swap_path,
    partition_layout,
)
from zoff.engine.disk.swapfile import folder_problem, shared_folder_problem
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy, engine_plan
from zoff.errors import UserError
from zoff.units import human


def check_swap_path(cfg: Config, model: nn.Module) -> None:
    """Before any rank starts: each swap folder of the disk tier (the optimizer's nvme_path, and parameter
    offload's, which may be the same one) exists, is a writable folder and has room for this node's swap files
    (every local rank's), and that zero.offload_optimizer.host_budget holds the tier's working set; a
    UserError naming the key, the path and the bytes otherwise."""
    if cfg.zero.offload_optimizer.device == "nvme":  # raises when a given size is below the working set
        disk_split(
            _plan(cfg, model), Policy.of(cfg.zero), cfg.zero, cfg.train.precision, _may_accumulate(cfg),
            host_budget_bytes(cfg.zero.offload_optimizer, mem_total(), cfg.launch.nproc_per_node),
            clipping=cfg.train.grad_clip > 0,
        )  # fmt: skip
    for path, (key, per_rank) in _swap_needs(cfg, model).items():
        if not path.is_dir():
            raise UserError(
                f"{key}: {path} {'is not a folder' if path.exists() else 'does not exist'} (create it on a local disk)"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"{key}: {path} is not writable")
        shared = shared_folder_problem(path)
        if shared is not None and not cfg.zero.offload_optimizer.allow_shared_path:
            raise UserError(
                f"{key}: {shared}: others could swap the rank folders for theirs; use a folder of your own, or "
                "set zero.offload_optimizer.allow_shared_path: true"
            )
        for rank in range(cfg.launch.nproc_per_node * cfg.launch.min_nodes):  # a rank folder planted there
            problem = folder_problem(path / f"rank{rank}")
            if problem is not None:
                raise UserError(f"{key}: {problem}")
        need, free = cfg.launch.nproc_per_node * per_rank, shutil.disk_usage(path).free
        if need > free:
            raise UserError(
                f"{key}: {path} has {human(free)} free; this node's swap files need {human(need)}"
            )


def _plan(cfg: Config, model: nn.Module) -> PartitionPlan:
    """The partition plan of the fewest ranks the run starts with (the most bytes per rank)."""
    return engine_plan(model, cfg.zero.stage, cfg.launch.min_world, cfg.zero)


def _swap_needs(cfg: Config, model: nn.Module, plan: PartitionPlan | None = None) -> dict[Path, list]:
    """Swap folder -> [its config key, bytes per rank] for the disk tier's files (none without one)."""
    zero = cfg.zero
    policy = Policy.of(zero)
    plan = plan or _plan(cfg, model)
    needs: dict[Path, list] = {}  # folder -> [config key, bytes per rank]
    # the largest gradient file: whatever the host budget, the file is there when it may be used (min)
    split = disk_split(
        plan, policy, zero, cfg.train.precision, _may_accumulate(cfg), None, clipping=cfg.train.grad_clip > 0
    )
    delayed = zero.offload_optimizer.delay_update  # DPU: two gradient files, two slots of parameters
    wanted = [  # (key, folder, bytes per rank, whether the policy swaps there at all)
        ("zero.offload_optimizer.nvme_path", zero.offload_optimizer.nvme_path,
         optimizer_disk_bytes(plan, policy), policy.offload_optimizer == "nvme"),
        ("zero.offload_optimizer.nvme_path", zero.offload_optimizer.nvme_path,
         grad_disk_bytes(plan, policy, split, _may_accumulate(cfg), cfg.train.precision, delayed),
         split.grads_on_disk),
        ("zero.offload_param.nvme_path" if zero.offload_param.nvme_path else "zero.offload_optimizer.nvme_path",
         param_swap_path(zero), param_disk_bytes(plan, policy, cfg.train.precision, delayed),
         policy.params_on_disk),
        ("zero.offload_optimizer.nvme_path", zero.offload_optimizer.nvme_path,
         next_params_bytes(plan, policy, cfg.train.precision, delayed), delayed and policy.offload_optimizer == "nvme"
         and not policy.params_on_disk),
    ]  # fmt: skip
    for key, where, nbytes, used in wanted:
        if used:  # (even with nothing to swap: the engine still opens its file there)
            entry = needs.setdefault(Path(where).expanduser(), [key, 0])
            entry[1] += nbytes
    return needs


def _may_accumulate(cfg: Config) -> bool:
    """Whether the gradient shard may accumulate in fp32 (the larger file): global_batch_size may derive it."""
    return cfg.train.grad_accum > 1 or cfg.train.global_batch_size is not None


def checkpoint_bytes(cfg: Config, model: nn.Module, plan: PartitionPlan | None = None) -> int:
    """One checkpoint of this run, all partitions: the shard files (partition_layout: every unit's fp32
    master and moments), stage 3's frozen shards and extra.safetensors (the rest of the state dict, counted in
    fp32: at least what it takes), and a MiB for the small files (rng states, manifest, config, headers)."""
    plan = plan or _plan(cfg, model)
    shards = plan.world_size * partition_layout([u.shard for u in plan.units]).nbytes
    frozen = plan.world_size * sum(4 * u.shard for u in plan.all_units[len(plan.units) :])
    trainable = {n for s in plan.all_slots for n in s.names}
    rest = sum(4 * math.prod(t.shape) for k, t in model.state_dict().items() if k not in trainable)
    return shards + frozen + rest + (1 << 20)


def check_checkpoint_room(cfg: Config, model: nn.Module, folder: Path) -> None:
    """The checkpoint folder (or the nearest folder above it that exists) has room for one checkpoint, and for
    this node's swap files too when they are on the same filesystem; a warning when it has less than
    keep_last + 1 (a new checkpoint is whole before the oldest is pruned)."""
    if not cfg.checkpoint.enabled:
        return
    key = "checkpoint.dir" if cfg.checkpoint.dir else "--run-dir"
    where = folder.expanduser()
    while not where.exists() and where != where.parent:
        where = where.parent
    if not (where.is_dir() and os.access(where, os.W_OK | os.X_OK)):
        if key == "--run-dir":  # the run directory is made next, and says why it cannot be
            return
        raise UserError(f"{key}: {where} is {'not writable' if where.is_dir() else 'not a folder'}")
    plan = _plan(cfg, model)
    one = checkpoint_bytes(cfg, model, plan)
    swaps = 0
    for path, (_, per_rank) in _swap_needs(cfg, model, plan).items():
        if path.is_dir() and os.stat(path).st_dev == os.stat(where).st_dev:
            swaps += cfg.launch.nproc_per_node * per_rank
    free = shutil.disk_usage(where).free
    if one + swaps > free:
        also = f" (and this node's swap files on the same disk {human(swaps)})" if swaps else ""
        raise UserError(
            f"{key}: {where} has {human(free)} free; one checkpoint of this run needs {human(one)}{also} "
            "(a larger disk, or checkpoint.enabled: false)"
        )
    keep = max(cfg.checkpoint.keep_last, 1) + 1
    if keep * one + swaps > free:
        print(
            f"zoff: warning: {where} has room for {int((free - swaps) // one)} checkpoint(s) of "
            f"{human(one)}; checkpoint.keep_last {cfg.checkpoint.keep_last} needs {keep} while a save runs",
            flush=True,
        )
