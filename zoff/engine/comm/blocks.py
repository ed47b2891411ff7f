"""When backward is done with a block: the gradients of the inputs of every call of it in this step exist.

Used twice: stage 3 frees a block's gathered weights then (with all its parameters' gradients in), and the
gradient reduction of every stage stops waiting for gradients of the block's parameters that did not come
(an expert no token of this micro-batch picked), so one idle expert does not hold back every reduction after
it until the end of backward. A gradient that still comes later is reduced as a correction (reduce.py), so
this signal only ever changes timing, never results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zoff.engine.partition import PartitionPlan, find_blocks


class BlockTracker:
    """Registers, in each forward of a block, a hook on its inputs' gradients; calls listeners when done."""

    def __init__(self, model: nn.Module, classes: tuple[str, ...] = ()):
        self.blocks = find_blocks(model, classes)
        self.in_backward = False  # set by the engine around loss.backward(): forwards then are recomputes
        self.listeners: list[Callable[[str], None]] = []
        self._open: dict[str, int] = {}  # per block: calls whose input gradients backward still owes
        modules = dict(model.named_modules())
        self._handles = [modules[b].register_forward_pre_hook(self._pre_forward(b)) for b in self.blocks]

    def slot_blocks(self, plan: PartitionPlan) -> list[str]:
        """The block each trainable parameter lives in ("" outside every block)."""
        longest_first = sorted(self.blocks, key=len, reverse=True)
        return [next((b for b in longest_first if s.names[0].startswith(b + ".")), "") for s in plan.slots]

    def open(self, block: str) -> int:
        return self._open.get(block, 0)

    def reset(self) -> None:
        """After backward (and before a step): hooks of a graph that got no backward are forgotten."""
        self.in_backward = False
        self._open.clear()

    def _pre_forward(self, block: str):
        def hook(module, args):
            # A recompute's inputs never get gradients of their own (activation checkpointing), and a forward
            # without grad has no backward: neither registers.
            if self.in_backward or not torch.is_grad_enabled():
                return
            inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                self._open[block] = self._open.get(block, 0) + 1
                torch.autograd.graph.register_multi_grad_hook(inputs, self._inputs_done(block), mode="all")

        return hook

    def _inputs_done(self, block: str):
        def hook(grads) -> None:
            self._open[block] -= 1
            if self._open[block] == 0:
                for listener in self.listeners:
                    listener(block)

        return hook
