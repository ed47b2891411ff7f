"""What stage 3 refuses, and how it finds it at once: a read of a released parameter (the guard) and a block
that some rank ran and another did not, or ran in another order (every gather names its unit to the peers).

The gatherer (gather.py) owns the state; this module owns the checks and their messages, each naming the
parameter or block, the ranks and the config key that fixes it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zoff.engine.comm.collectives import Handle
from zoff.errors import UserError


class UnsupportedModelError(UserError):
    """A model does something stage 3 cannot support; the message names the parameter and the module."""


class SkippedBlockError(UnsupportedModelError):
    """Ranks ran different blocks (data-dependent: an expert no token picked, a dropped layer). Not a dead
    end: gathering `block_class` (the module holding the block, every rank runs it) as one unit works, and
    `zoff train` restarts the run that way by itself (regather.py)."""

    def __init__(self, message: str, block_class: str):
        super().__init__(message)
        self.block_class = block_class


END = -1  # the code a rank sends when it has no more gathers in this forward or backward


class CheckedGather:
    """A gather whose peers name the unit they are gathering (Comm.exchange_codes); wait() checks the names
    before the data is used. A peer that gathers another unit, or has finished (END), makes every rank
    involved raise within one message's latency, naming the block and the ranks, instead of pairing the
    wrong buffers or waiting for the collective timeout. Cost on gloo: one 8-byte message per peer per gather."""

    def __init__(
        self, gatherer: GatherChecks, u: int, named: tuple[Handle, torch.Tensor | None] | None, gather: Handle
    ):
        self.gatherer, self.u, self.named, self.gather = gatherer, u, named, gather

    def wait(self) -> None:
        if self.named is not None:
            handle, codes = self.named
            handle.wait()
            self.named = None
            self.gatherer.check_codes(self.u, codes)
        self.gather.wait()


def _always_run_owner(model: nn.Module, block: str) -> str | None:
    """The class of the nearest module above `block` that is not a container (the MoE layer holding an expert
    list): a block of that class is gathered whenever it runs. None when that is the model itself."""
    parts = block.split(".")
    modules = dict(model.named_modules())
    for i in range(len(parts) - 1, 0, -1):
        owner = modules.get(".".join(parts[:i]))
        if owner is not None and not isinstance(owner, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            return type(owner).__name__
    return None


class GatherChecks:
    """The gatherer's checks (a mixin of UnitGatherer: model, plan, comm, in_backward are its attributes)."""

    broken = False  # a mismatch was found: the peers will answer no pending gather

    def checked_gather(self, u: int, issue: Callable[[], Handle]) -> CheckedGather:
        """Name unit u to the peers and issue its gather (`issue`). On gloo the names travel beside the data and
        are checked in wait(); with side checks (NCCL) they are checked first, so a mismatched NCCL gather is
        never issued."""
        named = self.comm.exchange_codes(u)
        if self.comm.side_checks:
            handle, codes = named
            handle.wait()
            self.check_codes(u, codes)
            named = None
        return CheckedGather(self, u, named, issue())

    def check_end(self) -> None:
        """This rank has no more gathers in this forward (or backward): tell the peers, and check that they
        have none either (a peer still gathering gets END instead of a unit, and raises too)."""
        done, codes = self.comm.exchange_codes(END)
        if codes is None:
            return
        done.wait()
        for q, v in enumerate(codes.tolist()):
            if v != END:  # peer q is gathering block v, which this rank did not run
                self.refuse(self.mismatch(v, skipped_by=self.comm.rank, ran_on=q), v)

    def check_codes(self, u: int, codes: torch.Tensor | None) -> None:
        """Every peer named unit u for this gather (Comm.exchange_codes); else say who ran what."""
        if codes is None:
            return
        for q, v in enumerate(codes.tolist()):
            if v == END:  # peer q finished its forward (or backward) without this block
                self.refuse(self.mismatch(u, skipped_by=q, ran_on=self.comm.rank), u)
            if v != u:
                self.refuse(
                    f"zero.stage 3: rank {self.comm.rank} gathered block '{self.block_name(u)}' while rank {q} "
                    f"gathered block '{self.block_name(v)}' in this {self._phase()}: the ranks ran different "
                    f"blocks, or the same ones in another order; {self.fix(u)}",
                    u,
                )

    def refuse(self, message: str, u: int) -> NoReturn:
        """Raise the mismatch found at block u, once every peer has read the same codes (Comm.confirm): each
        finds the mismatch itself from them, and a rank that left at once (taking the store it hosts, or
        having the launcher stop the others) could cut off a slower peer before it read them."""
        self.broken = True
        self.comm.confirm()
        raise SkippedBlockError(message, self.owner(u))

    def mismatch(self, u: int, skipped_by: int, ran_on: int) -> str:
        return (
            f"zero.stage 3: block '{self.block_name(u)}' ran on rank {ran_on} but rank {skipped_by} skipped it "
            f"in this {self._phase()} (a data-dependent block: an expert no token was routed to, a dropped "
            f"layer); {self.fix(u)}"
        )

    def _phase(self) -> str:
        return "backward" if self.in_backward else "forward"

    def block_name(self, u: int) -> str:
        modules = self.plan.all_units[u].modules
        return (modules[0] if modules else "") or "the root"

    def owner(self, u: int) -> str:
        """The class whose modules, gathered whole, hold block u and run on every rank."""
        return _always_run_owner(self.model, self.block_name(u)) or type(self.model).__name__

    def fix(self, u: int) -> str:
        """The config key that makes such a block gather with a module every rank runs."""
        owner = _always_run_owner(self.model, self.block_name(u))
        if owner is None:  # the block hangs off the model itself: only the whole model is always run
            return (
                f"gather the whole model as one unit, which every rank runs: zero.block_classes: "
                f"[{type(self.model).__name__}] (stage 2's parameter memory), or use zero.stage 2"
            )
        return (
            f"gather it with the module that holds it, which every rank runs: zero.block_classes: [{owner}] "
            "(or use zero.stage 2)"
        )

    # --------------------------------------------------------------------------------------------- guard
    def released_parameter(self, t: torch.Tensor) -> str | None:
        """The name of the released parameter `t` is (a view of), or None if `t` is not one."""
        storage = t.untyped_storage()
        for u, full in enumerate(self.full):
            if self.managed[u] and not self.gathered[u] and full.untyped_storage()._cdata == storage._cdata:
                at = t.storage_offset()
                for si in self.plan.all_units[u].slots:
                    s = self.plan.all_slots[si]
                    if s.offset <= at < s.offset + s.numel:
                        return s.names[0]
                return f"unit {u}"
        return None

    def reading_module(self) -> str:
        """The innermost module of this model whose code is running (for the error message)."""
        names = {id(m): n for n, m in self.model.named_modules()}
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if id(owner) in names:
                return names[id(owner)] or type(owner).__name__ + " (the model)"
            frame = frame.f_back
        return "unknown"


# Tensor functions that read only metadata: allowed on a released parameter (e.g. `x.to(w.dtype)`).
_METADATA = frozenset(
    "size dim ndimension numel nelement stride element_size is_floating_point is_complex is_contiguous "
    "get_device is_signed __len__ __hash__ new_empty new_zeros new_ones new_full zeros_like empty_like "
    "ones_like full_like requires_grad_ storage_offset".split()
)


class ReleasedReadGuard(TorchFunctionMode):
    """Turns a read of a released stage-3 parameter (freed storage: a crash or garbage) into a clear error.

    Cost: one Python call per torch function in the model's forward, about a microsecond plus a storage
    lookup per tensor argument; backward does not pass through it.
    """

    # train.compile sets it aside inside compiled blocks (trainer/compile.py): Dynamo cannot trace it
    compiled_regions_exempt = True

    def __init__(self, gatherer):
        super().__init__()
        self.gatherer = gatherer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (
            not self.gatherer.internal and name != "__get__" and name not in _METADATA
        ):  # property reads (w.dtype, w.shape) are metadata
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, list | tuple) else (a,):
                    if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().nbytes() == 0:
                        self._raise(t)
        return func(*args, **kwargs)

    def _raise(self, t: torch.Tensor) -> None:
        param = self.gatherer.released_parameter(t)
        if param is None:
            return
        block = next(
            (m for u in self.gatherer.plan.all_units for m in u.modules if param in _names(self.gatherer, u)),
            "",
        )
        raise UnsupportedModelError(
            f"zero.stage 3: parameter '{param}' was read by module '{self.gatherer.reading_module()}' outside "
            f"the forward of '{block}', the block that holds it, where it is not gathered (stage 3 gathers a "
            "block's parameters only while that block runs); read it inside that block, or use zero.stage 2"
        )


def _names(gatherer, unit) -> set[str]:
    return {n for si in unit.slots for n in gatherer.plan.all_slots[si].names}
