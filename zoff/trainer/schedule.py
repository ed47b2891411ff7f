"""Learning-rate schedule: a pure function of the step, so resuming needs nothing but the step."""

from __future__ import annotations

import math

from zoff.config import ScheduleConfig


def lr_at(step: int, base_lr: float, max_steps: int, cfg: ScheduleConfig) -> float:
    """LR for 0-based `step`: linear warmup to base_lr, then cosine/linear decay to min_lr_ratio*base_lr, or flat."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return base_lr
    span = max(1, max_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * frac)) if cfg.decay == "cosine" else 1.0 - frac
    lo = base_lr * cfg.min_lr_ratio
    return lo + (base_lr - lo) * shape
