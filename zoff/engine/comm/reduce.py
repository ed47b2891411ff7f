"""Gradient reduction during backward, correct for any pattern of parameter use.

Every rank issues the same collectives in the same order, whatever its data did: units are reduced in one
fixed order (the plan's units, last first: the order in which backward usually completes them), a unit is
launched once each of its parameters has its gradient or is settled (backward is done with its block,
blocks.py) *and* every unit before it in that order has been launched, and at the end of backward every unit
not yet launched is, with zeros for parameters that got no gradient on this rank (an unused expert, a branch
not taken, a frozen path). What this costs: a unit whose gradient does not come (an expert no token of this
micro-batch picked) holds back the units after it in the order until its block's backward is done (outside
a block, until the end of backward), so that step overlaps less of its communication.

A hook that fires again for a parameter whose unit is already on the wire (reentrant checkpointing of a
module called twice) is not lost: the late gradient is kept and, at the end of backward, a one-scalar-per-unit
all-reduce tells every rank which units need a correcting reduction, which all ranks then issue in order.
Each rank learns how many times each hook fires per backward, so the correction is paid once.

Stages 0-1 accumulate every micro-batch into persistent flat buffers and reduce on the last one (stage 1
under optimizer offload reduces as stage 2 does: no full gradient stays on the device). Stages 2-3 reduce
every micro-batch into the sharded accumulator (grad_store.py: on the device, or under offload in the
optimizer's tier, host memory or disk, as soon as each reduction finishes) and drop the full gradients at once (what
the ZeRO paper counts): on gloo each parameter's gradient is sent piecewise to the ranks that own it
(Comm.reduce_scatter_chunks) and dropped once sent; NCCL's reduce-scatter wants one flat input, so there
gradients are copied into a pooled bucket that lives until its unit is reduced. Autograd's gradients are
never written: one can share memory with another tensor's pending gradient (a parameter used through a view,
fixture DeltaLinear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoff.engine.comm.collectives import Comm, Handle
from zoff.engine.comm.landing import Landings
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy
from zoff.engine.pool import BufferPool
from zoff.engine.step.grad_store import GradShards

# Reductions in flight during backward; more overlap barely helps on 2 cores and each holds a unit's
# gradients (a bucket, or the held per-parameter gradients).
MAX_IN_FLIGHT = 2
# Backends whose reduce-scatter takes one flat input: stage 2/3 gradients are copied into buckets there.
FLAT_INPUT_BACKENDS = frozenset({"nccl"})


class GradReducer:
    """Owns the hooks' state: which gradients arrived, the launch cursor, buckets and reductions in flight."""

    def __init__(
        self,
        plan: PartitionPlan,
        comm: Comm,
        policy: Policy,
        gfull: list[torch.Tensor],
        grads: GradShards,
        *,
        dtype: torch.dtype,
        device: torch.device,
        overlap: bool,
        on_slot_done: Callable[[int], None] | None = None,
        slot_blocks: list[str] | None = None,
    ):
        self.plan, self.comm, self.policy, self.gfull, self.grads = plan, comm, policy, gfull, grads
        self.dtype, self.device, self.overlap, self.on_slot_done = dtype, device, overlap, on_slot_done
        # Landings through staging (a GPU's gradients coming down to the host tiers) run on a worker thread
        # (landing.py) while backward goes on; only with overlapped reductions, whose pooled buffers
        # (MAX_IN_FLIGHT + 1) also bound the landings pending. Not on a host-only machine: there the landing is
        # a host copy on the same two cores as backward, and moving it measured 1-2% slower (the 3.4B demo's
        # shape at 10 layers, the disk tier, 2026-11-27, two interleaved rounds).
        self.landings = Landings() if overlap and grads.staging is not None else None
        self.keep_full_grads = policy.keeps_full_grads  # full gradients accumulate in persistent flat buffers
        # Stage 2/3 on gloo: no bucket; autograd's gradients wait in _held until their unit is sent.
        self.direct = not self.keep_full_grads and comm.backend not in FLAT_INPUT_BACKENDS
        self.order = [u.index for u in reversed(plan.units)]  # the fixed reduction order, the same everywhere
        self.expected = [1] * len(plan.slots)  # hook firings per backward, learned (at least once each)
        self.corrections = 0  # correcting reductions issued so far (late gradients): each costs a reduction
        self._block_slots: dict[str, list[int]] = {}  # the parameters of each block (blocks.py)
        for slot, block in enumerate(slot_blocks or []):
            if block:
                self._block_slots.setdefault(block, []).append(slot)
        self._held: dict[int, dict[int, torch.Tensor]] = {}
        self._held_bytes = self._peak_held_bytes = 0
        self._handles: list[Handle] = []
        self._buckets: dict[int, torch.Tensor] = {}
        self._filled: dict[int, set[int]] = {}  # slots whose gradient is already in the unit's bucket
        self.zero_grad()
        self._begin_state(sync=True)
        # The filling bucket plus MAX_IN_FLIGHT being reduced: what memory.device_buffers estimates.
        # (and as many reduced shards on their way into the accumulator when accumulating at stages 2-3).
        largest = sorted((u.padded for u in plan.units), reverse=True)[: MAX_IN_FLIGHT + 1]
        self._max_shard = max((u.shard for u in plan.units), default=0)
        budget = sum(largest) + (MAX_IN_FLIGHT + 1) * self._max_shard
        self._pool = BufferPool(device, budget_bytes=budget * dtype.itemsize)
        # gloo's reduce-scatter receives other ranks' slices into scratch (collectives.py): N-1 slices when
        # the output is this rank's own slice of the input (stage 1's full buffers), N-2 otherwise, per
        # reduction in flight.
        slices = policy.receive_slices(comm.world)
        shards = sorted((u.shard for u in plan.units), reverse=True)[: MAX_IN_FLIGHT + 1]
        comm.scratch.budget = slices * sum(shards) * dtype.itemsize

    @property
    def mode(self) -> str:
        """How gradients are reduced: 'flat' (persistent full buffers), 'buckets' or 'direct' (per parameter)."""
        return "flat" if self.keep_full_grads else "direct" if self.direct else "buckets"

    @property
    def peak_bucket_bytes(self) -> int:
        """Most bytes of gradients waiting for their reduction at once: pooled buckets, or held gradients
        (plus, when accumulating at stages 2-3, the reduced shards on their way into the accumulator)."""
        return self._peak_held_bytes if self.direct else self._pool.peak_bytes

    # ------------------------------------------------------------------------------------------ lifecycle
    def zero_grad(self) -> None:
        """A new accumulation window: the next reduction of each unit writes its shard instead of adding."""
        self._fresh = [True] * len(self.plan.units)
        self.used = [False] * len(self.plan.slots)  # got a gradient on this rank in this window

    def _begin_state(self, sync: bool) -> None:
        self._sync = sync
        # Stages 2-3 reduce every micro-batch into the shard; stages 0-1 only the last one of the window.
        self._launching = sync or not self.keep_full_grads
        self._fires = [0] * len(self.plan.slots)
        # no more gradient expected: its block's backward is done (block_done)
        self._settled = [False] * len(self.plan.slots)
        self._launched = [False] * len(self.plan.units)
        self._cursor = 0
        self._late: dict[int, dict[int, torch.Tensor]] = {}

    def begin(self, sync: bool) -> None:
        """Before a micro-batch's backward; `sync` on the last micro-batch of a step."""
        self._wait_all()  # whatever a backward that raised half-way left in flight
        self._held.clear()
        self._held_bytes = 0
        for u in list(self._buckets):
            self._pool.give(self._buckets.pop(u))
        self._filled.clear()
        self._begin_state(sync)

    def end_backward(self) -> None:
        """After a micro-batch's backward (all hooks have run): launch what is left, in order; wait for all."""
        if not self._launching:
            return
        while self._cursor < len(self.order):
            self._launch(self.order[self._cursor])
        self._wait_all()
        self._correct_late()
        for slot, n in enumerate(self._fires):
            self.expected[slot] = max(self.expected[slot], n)
        self._fresh = [False] * len(self.plan.units)

    def _wait_all(self) -> None:
        for h in self._handles:
            h.wait()
        self._handles.clear()
        if self.landings is not None:
            self.landings.join()  # the store is whole before anyone reads it (corrections, norms, the step)

    # ---------------------------------------------------------------------------------------------- hooks
    def hook(self, slot: int) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of the parameter in `slot`."""
        s = self.plan.slots[slot]
        u = s.unit

        def hook(p: torch.Tensor) -> None:
            g, p.grad = p.grad.reshape(-1), None
            self._fires[slot] += 1
            self.used[slot] = True
            if self._fires[slot] == 1 and self.on_slot_done is not None:
                # stage 3 may release the block once all of its parameters have theirs
                self.on_slot_done(slot)
            if self._launched[u]:  # its unit is already being reduced: corrected at the end of backward
                late = self._late.setdefault(u, {})
                late[slot] = late[slot] + g if slot in late else g
                return
            if self.keep_full_grads:
                self.gfull[u][s.offset : s.offset + s.numel].add_(g)
            elif self.direct:
                held = self._held.setdefault(u, {})
                if slot in held:  # a second firing in this backward: sum (out of place, g is autograd's)
                    held[slot] = held[slot] + g
                else:
                    held[slot] = g
                    self._held_bytes += g.numel() * g.element_size()
                self._note_peak()
            else:
                piece = self._bucket(u)[s.offset : s.offset + s.numel]
                filled = self._filled[u]
                piece.add_(g) if slot in filled else piece.copy_(g)
                filled.add(slot)
            if self._launching:
                self._advance()

        return hook

    def block_done(self, block: str) -> None:
        """Backward is done with `block` (blocks.py): its parameters that got no gradient will get none (an
        idle expert), so their units need not wait for the end of backward. One that still does is late."""
        for slot in self._block_slots.get(block, ()):
            self._settled[slot] = True
        if self._launching:
            self._advance()

    def _advance(self) -> None:
        """Launch units in the fixed order for as long as the next one is complete."""
        while self._cursor < len(self.order):
            u = self.order[self._cursor]
            if any(
                self._fires[si] < self.expected[si] and not self._settled[si]
                for si in self.plan.units[u].slots
            ):
                return
            self._launch(u)

    def _note_peak(self) -> None:
        self._peak_held_bytes = max(self._peak_held_bytes, self._held_bytes + self._pool.held_bytes)

    def _bucket(self, u: int) -> torch.Tensor:
        """Stage 2/3 on NCCL: unit u's gradient bucket, taken from the pool on first use in this backward."""
        bucket = self._buckets.get(u)
        if bucket is None:
            bucket = self._buckets[u] = self._pool.take(self.plan.units[u].padded, self.dtype)
            self._filled[u] = set()
        return bucket

    # ------------------------------------------------------------------------------------------ reductions
    def _launch(self, u: int) -> None:
        self._launched[u] = True
        self._cursor += 1
        unit = self.plan.units[u]
        if self.keep_full_grads:
            full = self.gfull[u]
            if self.policy.all_reduces:
                self._track(self.comm.all_reduce(full, async_op=self.overlap), u, None)
            else:
                self._track(
                    self.comm.reduce_scatter(full, self.grads.target(u), async_op=self.overlap), u, None
                )
            return
        # Stages 2-3: into the shard on the window's first micro-batch, else into a buffer added to it; always
        # into a buffer when the accumulator is fp32 under 16-bit compute (the sum travels in 16 bits) or lies
        # off the device (offload: the buffer lands in the tier as soon as it is reduced).
        out = self.grads.target(u)
        if (
            out is None or not self._fresh[u] or out.dtype != self.dtype
        ):  # one size: the pool reuses MAX_IN_FLIGHT + 1 buffers
            out = self._pool.take(self._max_shard, self.dtype)[: unit.shard]
        self._note_peak()
        if self.direct:
            held = self._held.pop(u, {})
            nbytes = sum(g.numel() * g.element_size() for g in held.values())
            handle = self.comm.reduce_scatter_chunks(self._chunks(u, held), out, async_op=self.overlap)

            def release() -> None:
                self._held_bytes -= nbytes

            handle = Handle(then=release, after=handle)
        else:
            # A pooled bucket holds stale values wherever no gradient was copied in: unused parameters, padding.
            full = self._bucket(u)
            filled = self._filled.pop(u)
            for si in unit.slots:
                if si not in filled:
                    s = self.plan.slots[si]
                    full[s.offset : s.offset + s.numel].zero_()
            full[unit.numel :].zero_()
            handle = self.comm.reduce_scatter(full, out, async_op=self.overlap)
            # The bucket goes back to the pool once reduced: stage 2/3 hold at most the in-flight buckets.
            handle = Handle(then=lambda: self._pool.give(self._buckets.pop(u)), after=handle)
        self._track(handle, u, None if out is self.grads.target(u) else out, copy=self._fresh[u])

    def _chunks(self, u: int, grads: dict[int, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        """(offset, gradient) per slot of unit u, zeros where this rank has none."""
        out = []
        for si in self.plan.units[u].slots:
            s = self.plan.slots[si]
            g = grads.get(si)
            out.append(
                (s.offset, g if g is not None else torch.zeros(s.numel, dtype=self.dtype, device=self.device))
            )
        return out

    def _track(self, handle: Handle, u: int, addend: torch.Tensor | None, copy: bool = False) -> None:
        """Finish a reduction of unit u: land it in the gradient store (grad_store.py), which adds (or `copy`s)
        a buffer into the accumulator and averages on the last micro-batch.

        Sum, then average what this rank keeps (1/N of the elements for stages 1-3). Averaging before the sum
        (as DDP does) would need a pass over the full gradient, and on gloo a copy of it: the gradient
        autograd hands over must not be written (see hook). Cost: an fp16 sum can overflow where the mean
        would not; dynamic loss scaling then skips the step and lowers the scale (DeepSpeed's default
        post-division has the same trade).
        """
        # (stage 0's shard is its whole full buffer: the store's view of it)
        divide = self.comm.world if self._sync else 1
        final = self._sync

        def land() -> None:
            self.grads.land(u, addend, copy=copy, divide=divide, final=final)
            if addend is not None:
                self._pool.give(addend._base if addend._base is not None else addend)

        def finish() -> None:
            if self.landings is None or addend is None:
                land()
                return
            staging = self.grads.staging
            ready = staging.ready()

            def staged() -> None:
                with staging.ordered_after(ready):
                    land()

            self.landings.submit(staged)

        handle = Handle(then=finish, after=handle)
        if not self.overlap:
            handle.wait()
            return
        self._handles = [h for h in self._handles if not h.poll()]
        self._handles.append(handle)
        # bounds bucket memory when the network or the landings are the bottleneck: the pooled buffers in use
        # are the reductions in flight and the landings not done
        while len(self._handles) + self._pending_landings() > MAX_IN_FLIGHT:
            if self._pending_landings():
                self.landings.wait_oldest()
            else:
                self._handles.pop(0).wait()

    def settle(self) -> None:
        """After a backward that raised: let the landings already submitted finish (their own errors dropped),
        so nothing changes the store once the error has left backward."""
        if self.landings is not None:
            self.landings.drain()

    def check(self) -> None:
        """Before the step reads the store: every landing done, and a failed one raised (sticky)."""
        if self.landings is not None:
            self.landings.join()

    def close(self) -> None:
        if self.landings is not None:
            self.landings.close()

    def _pending_landings(self) -> int:
        return self.landings.pending if self.landings is not None else 0

    def _correct_late(self) -> None:
        """Reduce gradients that arrived after their unit was launched, on every rank that needs it.

        One all-reduce of a flag per unit (cheap: a few bytes per unit) makes every rank agree on which
        units get a correction, so the collectives stay in the same order everywhere.
        """
        if self.comm.world > 1:
            flags = self.comm.sum_scalars(
                [1.0 if u in self._late else 0.0 for u in range(len(self.plan.units))]
            )
            units = [u for u in self.order if flags[u] > 0]
        else:
            units = [u for u in self.order if u in self._late]
        scale = 1.0 / self.comm.world if self._sync else 1.0
        self.corrections += len(units)
        for u in units:
            unit, late = self.plan.units[u], self._late.pop(u, {})
            if self.direct:
                tmp = torch.zeros(unit.shard, dtype=self.dtype, device=self.device)
                self.comm.reduce_scatter_chunks(self._chunks(u, late), tmp).wait()
            else:
                full = torch.zeros(unit.padded, dtype=self.dtype, device=self.device)
                for si, g in late.items():
                    s = self.plan.slots[si]
                    full[s.offset : s.offset + s.numel].copy_(g)
                if self.policy.all_reduces:
                    self.comm.all_reduce(full).wait()
                    tmp = full
                else:
                    tmp = torch.zeros(unit.shard, dtype=self.dtype, device=self.device)
                    self.comm.reduce_scatter(full, tmp).wait()
            self.grads.correct(u, tmp, scale, final=self._sync)
