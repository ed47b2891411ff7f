"""The optimizer on a rank's partition: Adam(W) over flat fp32 shards, stepped run by run.

This is the seam where CPU offload swaps in zoff's fused CPU Adam; the engine only calls step() and the
state-dict methods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.optim.adam as torch_adam
import torch.optim.adamw as torch_adamw

from zoff.config import OptimConfig
from zoff.engine.partition import PartitionPlan

Run = tuple[int, int, bool]  # (start, end, weight-decayed) within a shard
# (start, end, weight-decayed, Adam step) within a shard: what one step updates, where some parameters got no
# gradient on any rank (they are skipped, like torch's optimizers skip a parameter whose .grad is None, and
# keep their own step count for the bias correction).
StepRun = tuple[int, int, bool, int]


def all_runs(runs: list[list[Run]], step: int) -> list[list[StepRun]]:
    """Every run of every shard at one step count: the usual case, when every parameter has a gradient."""
    return [[(a, b, decay, step) for a, b, decay in unit] for unit in runs]


def step_runs(
    plan: PartitionPlan, rank: int, unused: set[int], skipped: list[int], step: int
) -> list[list[StepRun]]:
    """What this step updates: every parameter with a gradient on some rank, at its own Adam step.

    torch's optimizers skip a parameter whose .grad is None (no gradient anywhere in the step: an expert
    no token picked on any rank): no weight decay, no moment decay, and its step count (bias correction)
    stays behind. zoff does the same, so its numbers equal plain PyTorch's; a zero gradient instead would
    still move the parameter. Cost: runs split at those parameters (one kernel call per run).
    """
    out: list[list[StepRun]] = []
    for unit in plan.units:
        lo, hi = plan.shard_range(unit.index, rank)
        runs: list[StepRun] = []
        for si in unit.slots:
            s = plan.slots[si]
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a >= b or si in unused:
                continue
            run = (a - lo, b - lo, s.decay, step - skipped[si])
            if runs and runs[-1][1] == run[0] and runs[-1][2:] == run[2:]:
                run = (runs.pop()[0], *run[1:])
            runs.append(run)
        out.append(runs)
    return out


class ShardAdam:
    """Adam(W) state for a list of flat fp32 master shards; each shard is stepped as at most two runs."""

    def __init__(self, masters: list[torch.Tensor], runs: list[list[Run]], cfg: OptimConfig):
        self.cfg = cfg
        self.masters, self.runs = masters, runs
        self.exp_avg = [torch.zeros_like(m) for m in masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in masters]
        self.step_count = 0
        # torch's fused CPU kernel streams memory at close to the machine's limit; its per-element math is the
        # same as the for-loop AdamW up to rounding of the scalar constants.
        self.fused = all(m.device.type in ("cpu", "cuda") for m in masters)

    def step(
        self,
        grads: list[torch.Tensor],
        lr: float,
        on_unit: Callable[[int], None] | None = None,
        runs: list[list[StepRun]] | None = None,
    ) -> bool:
        """One update; `grads` are fp32 shards aligned with the masters, already unscaled and clipped.

        `runs` (default: every run at this step's count) says what to update at which Adam step. `on_unit(i)`
        runs as soon as shard i is updated (the engine starts its all-gather there). Returns False: the update
        is complete on return (the offload optimizer may run it in the background).
        """
        self.step_count += 1
        c = self.cfg
        for i, unit_runs in enumerate(runs or all_runs(self.runs, self.step_count)):
            for a, b, decay, step in unit_runs:
                if b > a:
                    tensors = (self.masters[i], grads[i], self.exp_avg[i], self.exp_avg_sq[i])
                    self._adam(
                        *([t[a:b]] for t in tensors), lr=lr, weight_decay=c.weight_decay * decay, step=step
                    )
            if on_unit is not None:
                on_unit(i)
        return False

    def _adam(self, params, grads, m, v, *, lr: float, weight_decay: float, step: int) -> None:
        fn = torch_adamw.adamw if self.cfg.name == "adamw" else torch_adam.adam
        # the kernel increments them; torch's fused CUDA kernel reads them on the params' device
        steps = [torch.tensor(float(step - 1), device=p.device) for p in params]
        fn(
            params, grads, m, v, [], steps, fused=self.fused, foreach=False if not self.fused else None,
            amsgrad=False, beta1=self.cfg.betas[0], beta2=self.cfg.betas[1], lr=lr,
            weight_decay=weight_decay, eps=self.cfg.eps, maximize=False,
        )  # fmt: skip

    def finish(self) -> None:
        """Nothing runs in the background here (the offload optimizer's delayed update does)."""

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        for dst, src in zip(
            self.exp_avg + self.exp_avg_sq, list(state["exp_avg"]) + list(state["exp_avg_sq"])
        ):
            dst.copy_(src)
