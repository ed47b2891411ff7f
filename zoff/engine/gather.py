"""Stage 3: gather a module's parameters just before it runs (forward and backward) and free them after.

Each unit's full buffer keeps its tensor object for the whole run; parameters are views into it. Releasing
a unit resizes its storage to zero, gathering resizes it back and all-gathers the shards into it, so the
views (and autograd's saved references to the parameters) stay valid without any attribute on a Parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zoff.engine.collectives import Comm, Handle
from zoff.engine.partition import PartitionPlan


class UnitGatherer:
    """Owns the gathered/released state of stage 3's non-persistent units and the module hooks around them."""

    def __init__(
        self,
        model: nn.Module,
        plan: PartitionPlan,
        comm: Comm,
        full: list[torch.Tensor],
        shards: list[torch.Tensor],
        prefetch_numel: int,
    ):
        self.plan, self.comm, self.full, self.shards = plan, comm, full, shards
        self.prefetch_numel = prefetch_numel
        self.managed = [not u.persistent for u in plan.units]
        self.gathered = [u.persistent for u in plan.units]
        self.active = [0] * len(plan.units)  # modules inside their forward that use the unit
        self.pending: dict[int, Handle] = {}
        self.in_backward = False
        self.order: list[int] = []  # forward gather order, recorded in the first step, drives prefetch
        self.recording = True
        self.peak_gathered = 0
        self._handles = []
        by_module: dict[str, list[int]] = {}
        for u in plan.units:
            if not u.persistent:
                for m in u.modules:
                    by_module.setdefault(m, []).append(u.index)
        for name, module in model.named_modules():
            if name in by_module:
                units = tuple(by_module[name])
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(units)))
                self._handles.append(module.register_forward_hook(self._post_forward(units)))

    # -------------------------------------------------------------------------------------------- hooks
    def _pre_forward(self, units: tuple[int, ...]):
        def hook(module, args):
            for u in units:
                self.active[u] += 1
                self.gather(u, backward=False)

        return hook

    def _post_forward(self, units: tuple[int, ...]):
        def hook(module, args, output):
            for u in units:
                self.active[u] -= 1
            if not self.in_backward:
                for u in units:
                    if self.active[u] == 0:
                        self.release(u)
            if torch.is_grad_enabled():
                tensors = [
                    t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, self._pre_backward(units), mode="any"
                    )
            return None

        return hook

    def _pre_backward(self, units: tuple[int, ...]):
        def hook(grad):
            self.in_backward = True
            self.recording = False
            for u in units:
                self.gather(u, backward=True)

        return hook

    # ------------------------------------------------------------------------------------ gather/release
    def gather(self, u: int, backward: bool) -> None:
        if self.managed[u] and not self.gathered[u]:
            self._start(u)
        handle = self.pending.pop(u, None)
        if handle is not None:
            handle.wait()
        if not backward and self.recording and u not in self.order:
            self.order.append(u)
        self._prefetch_after(u, backward)
        self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())

    def _start(self, u: int) -> None:
        full = self.full[u]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self.gathered[u] = True
        shard = self.shards[u]
        if shard.device != full.device:  # parameter offload: the shard comes up from host memory first
            shard = shard.to(full.device, non_blocking=True)
        self.pending[u] = self.comm.all_gather(shard, full, async_op=True)

    def _prefetch_after(self, u: int, backward: bool) -> None:
        if self.recording or not self.prefetch_numel or u not in self.order:
            return
        seq = self.order[::-1] if backward else self.order
        budget = self.prefetch_numel
        for nxt in seq[seq.index(u) + 1 :]:
            # Units already held count against the window too, or each gather would reach another
            # prefetch_bucket_size further and the gathered set would grow toward the whole model.
            budget -= self.plan.units[nxt].padded
            if budget < 0:
                break
            if not self.gathered[nxt]:
                self._start(nxt)

    def release(self, u: int) -> None:
        if not self.managed[u] or not self.gathered[u]:
            return
        handle = self.pending.pop(u, None)
        if handle is not None:
            handle.wait()
        self.full[u].untyped_storage().resize_(0)
        self.gathered[u] = False

    def end_backward(self) -> None:
        """After backward: free whatever is still gathered (units with frozen or unused parameters)."""
        self.in_backward = False
        for u in range(len(self.full)):
            if self.active[u] == 0:
                self.release(u)

    def gathered_bytes(self) -> int:
        return sum(
            f.numel() * f.element_size()
            for u, f in enumerate(self.full)
            if self.managed[u] and self.gathered[u]
        )
