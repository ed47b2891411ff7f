"""The engine: everything that differs between ZeRO stages lives behind `build_engine`.

The trainer sees only: engine.model (call it), backward(loss, sync), step(lr) -> StepResult, zero_grad(),
memory_report(), stats(), gathered_params(), state_dict()/load_state_dict().
"""

from __future__ import annotations

import torch
from torch import nn

from zoff.config import OptimConfig, ZeroConfig
from zoff.engine.collectives import Comm
from zoff.engine.zero import StepResult, ZeroEngine
from zoff.errors import ConfigError

__all__ = ["build_engine", "StepResult", "ZeroEngine", "Comm"]


def build_engine(
    model: nn.Module,
    zero: ZeroConfig,
    optim: OptimConfig,
    *,
    precision: str = "fp32",
    grad_clip: float = 0.0,
    grad_accum: int = 1,
    device: torch.device | None = None,
    comm: Comm | None = None,
) -> ZeroEngine:
    """Wrap `model` for the ZeRO policy in `zero`; call on every rank after the process group is up."""
    if zero.offload_param.device != "none" and zero.stage != 3:
        raise ConfigError("zero.offload_param.device: parameter offload needs zero.stage 3")
    if zero.offload_param.device != "none" and zero.offload_optimizer.device == "none":
        raise ConfigError(
            "zero.offload_param.device: parameter offload needs zero.offload_optimizer.device cpu"
        )
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("zero.offload_optimizer.device: optimizer offload needs zero.stage 1, 2 or 3")
    return ZeroEngine(
        model, zero, optim, precision=precision, grad_clip=grad_clip, grad_accum=grad_accum, comm=comm,
        device=device,
    )  # fmt: skip
