"""Materialising a meta-device model into the engine's flat buffers, each rank drawing only what it owns."""

from __future__ import annotations

import torch
from torch import nn

from zoff.engine.partition import PartitionPlan


def init_owned(
    model: nn.Module, plan: PartitionPlan, u: int, full: torch.Tensor, shard: torch.Tensor, lo: int
) -> None:
    """Initialise the parameters of unit u that overlap this rank's shard [lo, lo + len(shard)), into it.

    Each rank draws only what it owns plus the rest of the (at most two) parameters that cross its shard's
    edges: O(psi/N) time and memory, not O(psi). Each parameter has its own generator (seeded by name), so
    the weights are the same at every world size and stage. A parameter that lies wholly in the shard is
    initialised in place; one that crosses an edge is drawn whole into a temporary and its piece copied.
    """
    hi = lo + shard.numel()
    for si in plan.units[u].slots:
        s = plan.slots[si]
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a >= b:
            continue
        if lo <= s.offset and s.offset + s.numel <= hi and full.untyped_storage().nbytes():
            model.init_parameter(s.names[0], full[s.offset : s.offset + s.numel].view(s.shape))
            if shard.data_ptr() != full[lo:hi].data_ptr():
                shard[a - lo : b - lo].copy_(full[a:b])
            continue
        tmp = torch.empty(s.shape, dtype=shard.dtype, device=shard.device)
        model.init_parameter(s.names[0], tmp)
        shard[a - lo : b - lo].copy_(tmp.view(-1)[a - s.offset : b - s.offset])


def replace_param(model: nn.Module, names: tuple[str, ...], value: torch.Tensor) -> nn.Parameter:
    """A materialised Parameter in place of a meta one, under every (tied) name."""
    # .data rather than Parameter(value): a Parameter made from a view shares the version counter of the
    # whole flat buffer, and every write into the buffer (a gather, the next unit's init) would then
    # invalidate what autograd saved of this parameter.
    param = nn.Parameter(torch.empty(0, dtype=value.dtype, device=value.device))
    param.data = value
    for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, param)
    return param
