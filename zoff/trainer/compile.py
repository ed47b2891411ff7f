"""train.compile: torch.compile each repeated block on its own (regional compilation).

Each block's `forward` is replaced by its compiled twin; the module's `__call__` stays eager, so the engine's
hooks on the block (stage 3's gathers and releases, the block tracker, activation checkpointing around it)
run as they do uncompiled, and blocks of one class share one compiled graph (their parameters are graph
inputs, not constants: a stage-3 gather that resizes a parameter's storage recompiles nothing).

Inside a compiled block the stage-3 read guard (gather_checks.ReleasedReadGuard, a TorchFunctionMode) is set
aside: Dynamo would trace into it, break the graph at every op and, under activation checkpointing, recompute
a different graph than the forward saved. Cost: a block that reads another block's released weight is not
named under compile (run without train.compile to find it); its own parameters are gathered by its hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zoff.engine.partition import find_blocks
from zoff.errors import UserError

# torch's own names for the time spent compiling (Dynamo with the forward's AOT compile, and the backward's
# compile, which AOTAutograd runs at the first backward); absent ones read as 0
_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


@dataclass(frozen=True)
class CompiledBlocks:
    """What train.compile compiled: block count per class and the backend."""

    classes: tuple[tuple[str, int], ...]
    backend: str

    def describe(self) -> str:
        blocks = ", ".join(f"{n} x {name}" for name, n in self.classes)
        return f"compile: {blocks} with torch.compile ({self.backend}), each class compiled in the first step"


def compile_seconds() -> float:
    """Seconds torch has spent compiling in this process so far (forward and backward graphs)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(k, ())) for k in _COMPILE_TIMERS)


def compile_blocks(model: nn.Module, block_classes: tuple[str, ...], backend: str) -> CompiledBlocks:
    """Compile every block of `model` in place (see the module's docstring); refuse a model without blocks."""
    names = find_blocks(model, tuple(block_classes))
    if not names:
        raise UserError(
            f"train.compile: {type(model).__name__} has no repeated blocks to compile one by one (a ModuleList "
            "or Sequential of two or more modules of one class, or a class named in zero.block_classes); "
            "set train.compile: false"
        )
    modules = dict(model.named_modules())
    counts: dict[str, int] = {}
    for name in names:
        block = modules[name]
        cls = type(block).__name__
        counts[cls] = counts.get(cls, 0) + 1
        block.forward = _compiled(block.forward, torch.compile(block.forward, backend=backend), cls)
    return CompiledBlocks(tuple(counts.items()), backend)


def _compiled(eager: Callable, compiled: Callable, cls: str) -> Callable:
    def forward(*args, **kwargs):
        with _guards_set_aside():
            try:
                return compiled(*args, **kwargs)
            except Exception as e:
                if not _is_compile_error(e):
                    raise
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UserError(
                    f"train.compile: torch.compile could not compile block class {cls} ({type(e).__name__}: "
                    f"{first}); set train.compile: false, or train.compile_backend: aot_eager to see whether "
                    "the backend is the cause"
                ) from e

    forward.__wrapped__ = eager  # what the block ran before (inspect and HF's signature checks read it)
    return forward


def _is_compile_error(e: BaseException) -> bool:
    """Dynamo's and Inductor's own errors (a model that cannot be traced or a kernel that fails to build),
    not the model's: those pass through as they would uncompiled."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


@contextlib.contextmanager
def _guards_set_aside() -> Iterator[None]:
    """Pop the torch-function modes that ask to stay out of compiled regions (`compiled_regions_exempt`) from
    the top of the stack for the call; put them back after."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

    popped = []
    stack = _get_current_function_mode_stack()
    while stack and getattr(stack[-1], "compiled_regions_exempt", False):
        popped.append(_pop_mode())
        stack = _get_current_function_mode_stack()
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)
