"""Gradient reduction during backward: per-parameter hooks fill units, full units are reduced at once.

Stages 0-1 keep the full gradients as views of persistent flat buffers (all-reduce / reduce-scatter them in
place). Stages 2-3 keep only their reduced shard: on gloo each parameter's own gradient is sent piecewise to
the ranks that own it (Comm.reduce_scatter_chunks) and dropped once sent, with no bucket held between
steps; NCCL's native reduce-scatter wants one flat input, so there each gradient is copied into a pooled
bucket that lives until its unit is reduced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoff.engine.collectives import Comm, Handle
from zoff.engine.partition import PartitionPlan
from zoff.engine.pool import BufferPool

# Reductions in flight during backward; more overlap barely helps on 2 cores and each holds a unit's
# gradients (a bucket, or the held per-parameter gradients).
MAX_IN_FLIGHT = 2
# Backends whose reduce-scatter takes one flat input: stage 2/3 gradients are copied into buckets there.
FLAT_INPUT_BACKENDS = frozenset({"nccl"})


class GradReducer:
    """Owns the hooks' state: which units are complete, the buckets, and the reductions in flight."""

    def __init__(
        self,
        plan: PartitionPlan,
        comm: Comm,
        stage: int,
        gfull: list[torch.Tensor],
        gshard: list[torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        overlap: bool,
        on_unit_done: Callable[[int], None] | None = None,
    ):
        self.plan, self.comm, self.stage, self.gfull, self.gshard = plan, comm, stage, gfull, gshard
        self.dtype, self.overlap, self.on_unit_done = dtype, overlap, on_unit_done
        self.keep_full_grads = stage <= 1  # p.grad lives as views in persistent flat buffers
        # Stage 2/3 on gloo: no bucket; autograd's gradients wait in _held until their unit is sent.
        self.direct = not self.keep_full_grads and comm.backend not in FLAT_INPUT_BACKENDS
        self._held: dict[int, dict[int, torch.Tensor]] = {}
        self._held_bytes = self._peak_held_bytes = 0
        self._pending = [len(u.slots) for u in plan.units]
        self._reduced = [False] * len(plan.units)
        self._handles: list[Handle] = []
        self._buckets: dict[int, torch.Tensor] = {}
        self._filled: dict[int, list[int]] = {}  # slots whose gradient is already in the unit's bucket
        self._sync = True
        # The filling bucket plus MAX_IN_FLIGHT being reduced: what memory.device_buffers estimates.
        largest = sorted((u.padded for u in plan.units), reverse=True)[: MAX_IN_FLIGHT + 1]
        self._pool = BufferPool(device, budget_bytes=sum(largest) * dtype.itemsize)
        # gloo's reduce-scatter receives other ranks' slices into scratch (collectives.py): N-1 slices when
        # the output is this rank's own slice of the input (stage 1), N-2 otherwise, per reduction in flight.
        slices = max(0, comm.world - (1 if stage == 1 else 2))
        shards = sorted((u.shard for u in plan.units), reverse=True)[: MAX_IN_FLIGHT + 1]
        comm.scratch.budget = slices * sum(shards) * dtype.itemsize

    @property
    def mode(self) -> str:
        """How gradients are reduced: 'flat' (persistent full buffers), 'buckets' or 'direct' (per parameter)."""
        return "flat" if self.keep_full_grads else "direct" if self.direct else "buckets"

    @property
    def peak_bucket_bytes(self) -> int:
        """Most bytes of gradients waiting for their reduction at once: pooled buckets, or held gradients."""
        return self._peak_held_bytes if self.direct else self._pool.peak_bytes

    def begin(self, sync: bool) -> None:
        """Before a micro-batch's backward; `sync` on the last micro-batch of a step reduces the gradients."""
        self._sync = sync
        if not self._handles:  # whatever a backward that raised half-way left behind must not be sent
            self._held.clear()
            self._held_bytes = 0
        self._pending = [len(u.slots) for u in self.plan.units]
        self._reduced = [False] * len(self.plan.units)

    def finish(self) -> None:
        """After the last micro-batch's backward: reduce what no hook reduced, wait for every reduction."""
        for u, done in enumerate(self._reduced):
            if not done:  # parameters that got no gradient this step (unused): reduce their zeros too
                self._reduce_unit(u)
        for h in self._handles:
            h.wait()
        self._handles.clear()

    def hook(self, slot: int) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of the parameter in `slot`."""
        s = self.plan.slots[slot]
        u = self.plan.units[s.unit]

        def hook(p: torch.Tensor) -> None:
            if self._sync and self.direct:
                # Sent as it is, never written: autograd may hand p a gradient whose memory another tensor's
                # pending gradient shares (p used through a view, e.g. W + p.view(..); fixture DeltaLinear).
                g = p.grad.reshape(-1)
                held = self._held.setdefault(u.index, {})
                if slot in held:  # the hook fired twice in one backward (e.g. reentrant checkpointing): sum
                    held[slot] = held[slot] + g
                else:
                    held[slot] = g
                    self._held_bytes += g.numel() * g.element_size()
                self._peak_held_bytes = max(self._peak_held_bytes, self._held_bytes)
                p.grad = None
            elif self._sync and not self.keep_full_grads:
                bucket = self._bucket(u.index)
                bucket[s.offset : s.offset + s.numel].copy_(p.grad.reshape(-1))
                self._filled[u.index].append(slot)
                p.grad = None
            self._pending[u.index] -= 1
            if self._pending[u.index] == 0:
                # Every use of the unit's parameters is behind us: stage 3 can drop the gathered copy now.
                if self.on_unit_done is not None:
                    self.on_unit_done(u.index)
                if self._sync:
                    self._reduce_unit(u.index)

        return hook

    def _bucket(self, u: int) -> torch.Tensor:
        """Stage 2/3: unit u's gradient bucket, taken from the pool on first use in this backward."""
        bucket = self._buckets.get(u)
        if bucket is None:
            bucket = self._buckets[u] = self._pool.take(self.plan.units[u].padded, self.dtype)
            self._filled[u] = []
        return bucket

    def _reduce_unit(self, u: int) -> None:
        self._reduced[u] = True
        unit = self.plan.units[u]
        if self.direct:
            self._reduce_held(u)
            return
        if self.keep_full_grads:
            full = self.gfull[u]
        else:
            # A pooled bucket holds stale values wherever no gradient was copied in: unused parameters, padding.
            full = self._bucket(u)
            filled = set(self._filled.pop(u))
            for si in unit.slots:
                if si not in filled:
                    s = self.plan.slots[si]
                    full[s.offset : s.offset + s.numel].zero_()
            full[unit.numel :].zero_()
        async_op = self.overlap
        if self.stage == 0:
            handle = self.comm.all_reduce(full, async_op=async_op)
        else:
            handle = self.comm.reduce_scatter(full, self.gshard[u], async_op=async_op)
        if not self.keep_full_grads:
            # The bucket goes back to the pool once reduced: stage 2/3 hold at most the in-flight buckets.
            handle = Handle(then=lambda: self._pool.give(self._buckets.pop(u)), after=handle)
        self._track(handle, u)

    def _reduce_held(self, u: int) -> None:
        """Stage 2/3 on gloo: send the unit's gradients as they are; zeros for parameters that got none."""
        held = self._held.pop(u, {})
        chunks = []
        for si in self.plan.units[u].slots:
            s = self.plan.slots[si]
            g = held.get(si)
            chunks.append(
                (
                    s.offset,
                    g if g is not None else torch.zeros(s.numel, dtype=self.dtype, device=self._pool.device),
                )
            )
        nbytes = sum(g.numel() * g.element_size() for g in held.values())
        handle = self.comm.reduce_scatter_chunks(chunks, self.gshard[u], async_op=self.overlap)

        def release() -> None:
            self._held_bytes -= nbytes

        self._track(Handle(then=release, after=handle), u)

    def _track(self, handle: Handle, u: int) -> None:
        # Sum, then average what this rank keeps (1/N of the elements for stages 1-3). Averaging before the
        # sum (as DDP does) would need a pass over the full gradient, and on gloo a copy of it: the gradient
        # autograd hands over must not be written (see hook). Cost: an fp16 sum can overflow where the mean
        # would not; dynamic loss scaling then skips the step and lowers the scale (DeepSpeed's default
        # post-division has the same trade).
        if self.comm.world > 1:
            out = self.gfull[u] if self.stage == 0 else self.gshard[u]
            handle = Handle(then=lambda: out.div_(self.comm.world), after=handle)
        if not self.overlap:
            handle.wait()
            return
        self._handles = [h for h in self._handles if not h.poll()]
        self._handles.append(handle)
        while len(self._handles) > MAX_IN_FLIGHT:  # bounds bucket memory when the network is the bottleneck
            self._handles.pop(0).wait()
