"""train.activation_offload: the inputs activation checkpointing keeps for each block live in host memory.

With checkpointing a block keeps only its input (tokens x d) until backward recomputes it; over L blocks those
inputs are what remains of the activations (16.2 GiB of configs/gpt-7b.yaml's at context 32768). Here each
input is copied to a page-locked host buffer on a side stream as the block's forward runs (the device copy
is freed as soon as that copy has read it), and backward brings it back one block ahead: when block k's
recompute asks for its input, block k-1's is already on its way. Results are unchanged: the recompute runs on
a bit-identical copy, and autograd's graph still runs through the original tensor.

How: the block goes to torch's non-reentrant checkpoint with a `HostSaved` handle in place of each floating
input that requires grad (the residual stream; rotary tables and masks, shared by every block, stay), and the
function checkpoint runs unwraps them. In forward that gives the device tensor itself; in the recompute the
fetched copy, marked as requiring grad so that autograd records (and checkpoint's check of the recomputed
tensors sees) the same operations as in forward. Nothing else holds the input: checkpoint keeps its
arguments (the handle) and the saved tensors it discards.

On a host without a GPU the same code runs with host buffers (not pinned) and null streams, so the tests cover
it here; the memory simply moves from one host tensor to another.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from zoff.engine.pool import BufferPool
from zoff.engine.staging import NullEvent
from zoff.units import human


class HostSaved:
    """One block input: the device tensor until its host copy is issued, then the host copy."""

    def __init__(self, offload: ActivationOffload, x: torch.Tensor):
        self.offload, self.index = offload, len(offload.refs)
        offload.refs.append(weakref.ref(self))  # (now: the next input of the same call gets the next index)
        # The host copy lives in a box the finalizer shares: a handle whose graph is dropped before its backward
        # ran (a forward that raised, a loss never backpropagated) gives its buffer back when it dies.
        self._box: list[torch.Tensor | None] = [None]
        weakref.finalize(self, offload.release, self._box)
        self.device_x: torch.Tensor | None = x
        # a block that changes its own input in place would recompute from the changed values
        self.version = x._version
        self.shape, self.dtype, self.device, self.requires_grad = x.shape, x.dtype, x.device, x.requires_grad
        self.fetched: torch.Tensor | None = None
        self.event = offload.new_event()

    @property
    def host(self) -> torch.Tensor | None:
        return self._box[0]

    def store(self) -> None:
        """Copy to the host on the side stream; the device tensor is the allocator's again once the copy ran."""
        x, off = self.device_x, self.offload
        # (plain checkpoint refuses this in backward; here the host copy would hide it)
        if x._version != self.version:
            raise RuntimeError(
                "train.activation_offload: a checkpointed block changed its input in place during its forward, "
                "so its recompute would start from the changed values; make the op out of place or set "
                "train.activation_offload: false"
            )
        self._box[0] = off.pool.take(x.numel(), x.dtype)
        with off.on_side():
            self.host.copy_(x.reshape(-1), non_blocking=off.cuda)
            self.event.record(off.stream)
        if off.cuda:
            x.record_stream(off.stream)  # (the caching allocator reuses its memory only after the copy)
        self.device_x = None
        with off._lock:
            off.stored_bytes += x.numel() * x.element_size()
            off.peak_stored_bytes = max(off.peak_stored_bytes, off.stored_bytes)
        off.check_budget()

    def prefetch(self) -> None:
        """Issue the copy back to the device on the side stream (after the copy out has finished)."""
        if self.fetched is not None or self.host is None:
            return
        off = self.offload
        with off.on_side():
            self.event.synchronize() if not off.cuda else off.stream.wait_event(self.event)
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            out.reshape(-1).copy_(self.host, non_blocking=off.cuda)
            self.event.record(off.stream)
        self.fetched = out

    def get(self) -> torch.Tensor:
        """The input: the device tensor in forward, the fetched copy in backward's recompute."""
        if self.device_x is not None:
            return self.device_x
        off = self.offload
        self.prefetch()
        before = off.refs[self.index - 1]() if self.index > 0 else None
        if before is not None:  # the block before this one recomputes next: start its copy now
            before.prefetch()
        if off.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.fetched.record_stream(torch.cuda.current_stream(self.device))
        x, self.fetched = self.fetched, None
        self.event.synchronize()  # (the host buffer is read: it can serve another input)
        off.release(self._box)
        return x.detach().requires_grad_(self.requires_grad)


class ActivationOffload:
    """The handles of one forward's checkpointed blocks and the host buffers they use (reused every step)."""

    def __init__(self, device: torch.device, budget_bytes: int | None = None):
        """`budget_bytes`: the plan's host bytes for one forward's inputs (planning.memory's
        activation_offload_budget, what `zoff estimate` counts); the pool keeps to it, giving free buffers back
        to the allocator (a forward that raised, a shorter sequence), and a forward that needs more is said
        once. None: a model the plan does not size; nothing is bounded."""
        self.cuda = device.type == "cuda"
        self.budget = budget_bytes
        self.pool = BufferPool(torch.device("cpu"), budget_bytes, pin=self.cuda)
        self.over_budget = False  # (said once)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.refs: list[weakref.ref] = []  # this forward's handles, in order (a handle lives with its graph)
        self.stored_bytes = self.peak_stored_bytes = 0
        self._lock = threading.Lock()  # a finalizer may run on autograd's thread

    @property
    def saved(self) -> list[HostSaved]:
        """The live handles of this forward, in order."""
        return [h for h in (r() for r in self.refs) if h is not None]

    def drop(self) -> None:
        """Forget this forward: every handle's host copy back to the pool, the next call a new forward."""
        for h in self.saved:
            h.device_x = None
            self.release(h._box)
        self.refs = []

    def release(self, box: list) -> None:
        """A handle's host copy is no longer needed (fetched, or its handle is gone): back to the pool."""
        with self._lock:
            host, box[0] = box[0], None
            if host is not None:
                self.stored_bytes -= host.numel() * host.element_size()
        if host is not None:
            self.pool.give(host)

    def describe(self) -> str:
        """The start-up plan's line."""
        where = "page-locked host memory" if self.cuda else "host memory"
        if self.budget is None:
            return (
                f"activation offload: the blocks' inputs in {where}, not sized by the plan (a probed model)"
            )
        return f"activation offload: the blocks' inputs in {where}, {human(self.budget)} per rank (budget)"

    def check_budget(self) -> None:
        """One line, once, when this forward's host copies pass the plan's budget: the estimate under-counted
        them (a model whose blocks take more than the residual stream), so the host may not hold the plan."""
        if self.budget is None or self.over_budget or self.stored_bytes <= self.budget:
            return
        self.over_budget = True
        print(
            f"zoff: warning: train.activation_offload holds {human(self.stored_bytes)} of block inputs "
            f"in host memory, more than the plan's {human(self.budget)} per rank (zoff estimate's); "
            "the host needs the difference too",
            file=sys.stderr, flush=True,
        )  # fmt: skip

    def new_event(self):
        return torch.cuda.Event() if self.cuda else NullEvent()

    def on_side(self):
        if not self.cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())  # after the compute that made the tensor
        return torch.cuda.stream(self.stream)

    def checkpoint(self, fn: Callable, *args, **kwargs):
        """torch.utils.checkpoint.checkpoint(fn, *args, **kwargs) (non-reentrant), its block inputs offloaded."""
        kwargs.pop("use_reentrant", None)
        if all(h.host is None and h.device_x is None for h in self.saved):
            # every input of the last forward was consumed by its backward, or dropped with its graph (a
            # forward that raised): a new forward. (The list grew by each raised forward's handles.)
            self.refs = []
        handles = [
            HostSaved(self, a)
            if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point()
            else a
            for a in args
        ]
        # torch's checkpoint saves and restores the RNG state of the devices its tensor arguments are on; with
        # the inputs behind handles it would see none on the GPU, and a recompute's dropout would draw other
        # masks than the forward's. An empty tensor on the inputs' device keeps the GPU's RNG state saved.
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        anchor = torch.empty(0, device=device)

        def run(_anchor, *inputs, **kw):
            return fn(*(a.get() if isinstance(a, HostSaved) else a for a in inputs), **kw)

        try:
            out = checkpoint(run, anchor, *handles, use_reentrant=False, **kwargs)
        except BaseException:
            # This forward has no backward now. torch's checkpoint keeps the raising call's frame, and with it
            # the blocks' handles before it, alive after the error is handled: give their copies back here.
            self.drop()
            raise
        for h in handles:
            if isinstance(h, HostSaved):
                h.store()
        return out
