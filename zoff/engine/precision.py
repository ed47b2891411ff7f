"""Mixed precision: compute dtypes and fp16's dynamic loss scale."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """fp16 dynamic loss scale: halve on overflow (the step is skipped), double after `growth_interval` clean steps.

    bf16 and fp32 use scale 1 and never skip: their exponent range does not overflow where fp16's does.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.skipped = state["scale"], state["clean_steps"], state["skipped"]
