"""Mixed precision: compute dtypes, fp16's dynamic loss scale, and the gradients' coefficient (unscale and clip)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """fp16 dynamic loss scale: halve on overflow (the step is skipped), double after `growth_interval` clean steps.

    bf16 and fp32 use scale 1 and never scale: their exponent range does not overflow where fp16's does (a
    non-finite step is still skipped at every precision, zero.py's step; this counts fp16's alone).
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


def clip_factor(norm: float, clip: float) -> float:
    """The step's clipping factor for a global gradient norm (clip 0: no clipping): exactly 1.0 where the clip
    does not trigger, which is what a speculated update's commit checks (NaN gives NaN, never 1.0);
    scripts/clip_frequency.py counts the steps of a real run with the same function."""
    return min(clip / (norm + 1e-6), 1.0) if clip > 0 else 1.0


class RescaledGrads:
    """The step's gradient shards times `coef` (unscaling and clipping), unit by unit, from their store.

    Resident fp32 shards are scaled in place at once; shards on disk (grad_swap.DiskGrads) are read unit by
    unit and fp32 ones scaled in their read buffer. A 16-bit shard is never scaled where it lies (that would
    round the product back to 16 bits): with `fused` (zoff's CPU kernel, which multiplies in registers) it goes
    to the kernel as it is and scale(i) says by what; otherwise it becomes an fp32 copy when the optimizer
    reaches its unit, one at a time. The copy is what fusing saves: per unit a fresh fp32 tensor (4 B/param,
    allocated and page-faulted), the conversion and the multiply, each a pass over memory, and the kernel then
    reads 4 B/param instead of 2. A list of such copies would be a whole fp32 copy of the gradient shard
    (13 GB for a 3.3B model on one rank), which the disk tier exists to avoid.
    x * 1.0 is exact, so with nothing to rescale the shards go as they are (bit-identical results).
    """

    def __init__(self, store, coef: float, fused: bool = False):
        self.store, self.coef, self.fused = store, coef, fused  # store: a grad_store.GradShards
        self._last: tuple[int, torch.Tensor] | None = None
        if coef != 1.0 and store.resident:
            for g in store.shards:
                if g.dtype == torch.float32:
                    g.mul_(coef)

    def __len__(self) -> int:
        return len(self.store.numels) if not self.store.resident else len(self.store.shards)

    def scale(self, i: int) -> float:
        """What the kernel multiplies unit i's shard (as __getitem__ returns it) by: 1.0 unless `fused`."""
        dtype = self.store.shards[i].dtype if self.store.resident else self.store.dtype  # never a disk read
        return self.coef if self.fused and dtype != torch.float32 else 1.0

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        g = self.store.get(i)
        if self.coef != 1.0:
            if g.dtype != torch.float32:
                if not self.fused:
                    g = g.float().mul_(self.coef)
            elif not self.store.resident:  # a read buffer of its own: scaled where it lies
                g.mul_(self.coef)
        self._last = (i, g)
        return g

    def __iter__(self):
        return (self[i] for i in range(len(self)))
