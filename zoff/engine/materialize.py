"""Putting the model's parameters into the engine's flat buffers: each unit a padded buffer identical on every
rank (rank 0's values broadcast, or a meta-device model materialised with each rank drawing only what it
owns), the parameters becoming views into it, and the gradient buffers beside them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zoff.engine.comm.collectives import Comm
from zoff.engine.disk.param_swap import SwappedShards
from zoff.engine.partition import PartitionPlan
from zoff.engine.step.tiers import host_buffer


def prepare_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, bool]:
    """(the model on the device, whether it is deferred). A meta-device model is materialised unit by unit in
    FlatBuffers.build: no rank ever holds the whole model unless its stage keeps it whole anyway."""
    deferred = any(p.is_meta for p in model.parameters())
    if deferred and (not hasattr(model, "init_parameter") or any(t.is_meta for t in model.buffers())):
        raise ValueError("a meta-device model needs init_parameter() and no meta buffers")
    model = model if deferred else model.to(device)
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():  # frozen params compute in the same dtype
            p.data = p.data.to(dtype)
    # Buffers keep their dtype, as under torch autocast and FSDP2: an fp32 rotary inv_freq cast to bf16
    # would put large errors into the angles of long positions.
    return model, deferred


@dataclass
class FlatBuffers:
    """Per unit (trainable ones, then stage 3's frozen ones): the full buffer, this rank's shard of it, and,
    for trainable units where full gradients are kept, the full gradient buffer and its shard (a view)."""

    params: list[nn.Parameter]  # the distinct trainable parameters, in slot order
    full: list[torch.Tensor] = field(default_factory=list)
    shards: list[torch.Tensor] = field(default_factory=list)
    gfull: list[torch.Tensor] = field(default_factory=list)
    gshard: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def build(
        cls, model: nn.Module, plan: PartitionPlan, comm: Comm, *, stage: int, rank: int, dtype: torch.dtype,
        device: torch.device, deferred: bool, keep_full_grads: bool, host_shards: bool,
        pin_host_shards: bool, disk: SwappedShards | None = None,
    ) -> FlatBuffers:  # fmt: skip
        """`disk`: parameter offload to nvme; each sharded unit's shard is written there as soon as it is made,
        and its place in `shards` is a meta tensor (shape and dtype, no memory)."""
        named = dict(model.named_parameters(remove_duplicate=False))
        out = cls([named[s.names[0]] for s in plan.slots])
        frozen = [named[s.names[0]] for s in plan.frozen_slots]
        for u in plan.all_units:
            lo, hi = plan.shard_range(u.index, rank)
            sharded = stage == 3 and not u.persistent  # only the shard stays; the full buffer is freed
            # empty, not zeros, for a buffer that is freed at once: its pages are never touched
            full = (torch.empty if sharded else torch.zeros)(u.padded, dtype=dtype, device=device)
            full[u.numel :].zero_()  # the padding (empty's pages stay untouched but for this tail)
            for si in u.slots:
                s = plan.all_slots[si]
                view = full[s.offset : s.offset + s.numel].view(s.shape)
                if deferred:
                    trainable = si < len(plan.slots)
                    param = replace_param(model, s.names, view, requires_grad=trainable)
                    if trainable:
                        out.params[si] = param
                else:
                    param = out.params[si] if si < len(plan.slots) else frozen[si - len(plan.slots)]
                    view.copy_(param.detach())
                    param.data = view
            if sharded:
                shard = torch.zeros(u.shard, dtype=dtype, device=device)
                if host_shards:  # stage 3 parameter offload: the shard lives on the host
                    shard = host_buffer(shard, dtype, pin_host_shards)
                if deferred:
                    init_owned(model, plan, u.index, full, shard, lo)
                else:
                    comm.broadcast(full, src=0)
                    shard.copy_(full[lo:hi])
                # Released at once (the gatherer starts with every managed unit released): holding all the
                # full buffers until the end would put a whole model copy into this rank's peak memory.
                full.untyped_storage().resize_(0)
                if disk is not None:
                    disk.write(u.index, 0, shard)
                    shard = torch.empty(u.shard, dtype=dtype, device="meta")
            else:  # the full buffer stays: the shard is a view, not a copy
                shard = full[lo:hi]
                if deferred:  # stage 0: one partition, which every rank owns
                    init_owned(
                        model, plan, u.index, full, shard if stage >= 1 else full, lo if stage >= 1 else 0
                    )
                    if stage >= 1:
                        comm.all_gather(shard, full)
                else:
                    comm.broadcast(full, src=0)
            out.full.append(full)
            out.shards.append(shard)
            if u.index < len(
                plan.units
            ):  # trainable: gradients (frozen units have none, nor optimizer state)
                out._add_grads(u, lo, hi, keep_full_grads, dtype, device)
        if disk is not None:
            disk.flush()
        if deferred:
            materialize_whole(model, plan.frozen, dtype, device)
        return out

    def _add_grads(self, u, lo: int, hi: int, keep_full: bool, dtype, device) -> None:
        if keep_full:  # stages 0-1: whole gradients accumulate in persistent flat buffers
            g = torch.zeros(u.padded, dtype=dtype, device=device)
            self.gfull.append(g)
            self.gshard.append(g[lo:hi])
        # stages 2-3 (and 1 under offload): the shard lives in the optimizer's tier (grad_store.py)


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
    for si in plan.all_units[u].slots:  # a trainable unit, or one of stage 3's frozen units
        s = plan.all_slots[si]
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


def materialize_whole(
    model: nn.Module, names: tuple[str, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """The frozen parameters every rank keeps whole (stages 0-2, and stage 3's small ones: the plan's `frozen`),
    drawn or read whole on every rank: a LoRA base at stages 0-2 is whole on every rank anyway."""
    named = dict(model.named_parameters(remove_duplicate=False))
    done: set[int] = set()
    for name in names:
        p = named[name]
        if not p.is_meta or id(p) in done:
            continue
        done.add(id(p))
        value = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
        model.init_parameter(name, value)
        aliases = tuple(n for n, q in named.items() if q is p)
        replace_param(model, aliases, value, requires_grad=False)


def replace_param(
    model: nn.Module, names: tuple[str, ...], value: torch.Tensor, requires_grad: bool = True
) -> nn.Parameter:
    """A materialised Parameter in place of a meta one, under every (tied) name."""
    # .data rather than Parameter(value): a Parameter made from a view shares the version counter of the
    # whole flat buffer, and every write into the buffer (a gather, the next unit's init) would then
    # invalidate what autograd saved of this parameter.
    param = nn.Parameter(torch.empty(0, dtype=value.dtype, device=value.device), requires_grad=requires_grad)
    param.data = value
    for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, param)
    return param
