"""The engine: everything that differs between ZeRO stages lives behind `build_engine`.

The trainer sees: engine.model (call it), backward(loss, sync), step(lr) -> StepResult, zero_grad(), flush(),
close(), memory_report()/planned_memory()/pinned_bytes(), stats(); checkpoints add state_dict()/
load_state_dict() and read the plan, the optimizer and the shards (param_shard(), load_frozen_shards()).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zoff.config import OptimConfig, ZeroConfig, check_grad_device
from zoff.engine.comm.collectives import Comm
from zoff.engine.policy import Policy
from zoff.engine.pool import mmap_large_allocations
from zoff.engine.zero import StepResult, ZeroEngine
from zoff.errors import ConfigError

__all__ = ["build_engine", "StepResult", "ZeroEngine", "Comm"]


def build_engine(model: nn.Module, zero: ZeroConfig, optim: OptimConfig, **options: Any) -> ZeroEngine:
    """Wrap `model` for the ZeRO policy in `zero`; call on every rank after the process group is up.

    `options` are ZeroEngine's keywords: precision ("fp32"), grad_clip (0), grad_accum (1), device (cpu),
    comm (this process's group), host_reserved (0: the rank's host bytes besides the disk tier's, which
    zero.offload_optimizer.host_budget holds too). An invalid policy is a ConfigError naming the key. Also switches this
    process's allocator to mmap large buffers (pool.mmap_large_allocations): without it a stage-3 rank's peak
    memory grows with the freed gathers; constructing ZeroEngine directly skips that.
    """
    # Process-wide, said here rather than hidden in the engine: large allocations get their own mappings, so
    # freed stage-3 and bucket memory goes back to the OS instead of fragmenting the heap (pool.py).
    mmap_large_allocations()
    bad = Policy.of(zero).invalid()
    if bad is not None:
        raise ConfigError(f"{bad[0]}: {bad[1]}")
    check_grad_device(zero)
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in zero.block_classes if c not in present]
    if missing:
        raise ConfigError(
            f"zero.block_classes: no module of class {missing[0]!r} in the model (its classes: "
            f"{', '.join(sorted(present))})"
        )
    return ZeroEngine(model, zero, optim, **options)
