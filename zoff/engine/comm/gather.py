"""Stage 3: gather a block's parameters around its forward and its backward, and free them after.

Gathers follow the model's structure like FSDP2's: each repeated block (partition.find_blocks) is gathered
whole, all its units together, and the root units hold everything else (embeddings, final norm, head). The
root units are gathered when the model's forward starts and stay gathered until backward ends, so any code
outside the blocks may read any of those parameters (a functional tie such as `F.linear(h, self.emb.weight)`);
a block's units are gathered for the whole of the block's forward, so code inside it may read any of the
block's parameters. A block is released after its forward and gathered again before its backward, by a hook
on its outputs' gradients, which runs before any recompute of the block (activation checkpointing runs the
block's forward again, through its hooks or, as transformers does, its bare `forward`, and may stop part-way:
nothing here counts on a post-forward hook running in backward). It is released once its trainable
parameters have their gradients and its inputs' gradients exist (blocks.py), and at the end of backward
whatever is still gathered is released, so no gathered copy outlives a step (the next forward must see the
updated shards).

Each unit's full buffer keeps its tensor object for the whole run; parameters are views into it. Releasing
resizes its storage to zero, gathering resizes it back and all-gathers the shards into it, so the views (and
autograd's saved references to the parameters) stay valid without any attribute on a Parameter. Reading a
released parameter would touch freed memory: while the model's forward runs, a torch function mode checks
tensor arguments and raises UnsupportedModelError naming the parameter and the module that read it.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zoff.engine.comm.blocks import BlockTracker
from zoff.engine.comm.collectives import Comm, Handle
from zoff.engine.comm.gather_checks import GatherChecks, ReleasedReadGuard, UnsupportedModelError
from zoff.engine.disk.param_swap import ShardRead, SwappedShards
from zoff.engine.partition import PartitionPlan
from zoff.engine.staging import NullEvent


class UnitGatherer(GatherChecks):
    """Owns the gathered/released state of stage 3's non-persistent units and the module hooks around them."""

    def __init__(
        self,
        model: nn.Module,
        plan: PartitionPlan,
        comm: Comm,
        full: list[torch.Tensor],
        shards: list[torch.Tensor],
        prefetch_numel: int,
        blocks: BlockTracker,
        disk: SwappedShards | None = None,
    ):
        self.model, self.plan, self.comm, self.full, self.shards = model, plan, comm, full, shards
        self.disk = disk  # parameter offload to nvme: the shards are read from their swap file per gather
        self.reading: list[tuple[int, ShardRead]] = []  # disk gathers started, all-gather not yet issued
        self.blocks = blocks  # also says whether backward is running (a forward then is a recompute)
        blocks.listeners.append(self._maybe_release)
        self.prefetch_numel = prefetch_numel
        self.managed = [not u.persistent for u in plan.all_units]
        # Parameter offload: the last upload of a host shard, which the host must not overwrite (the step's
        # publish) before the GPU has read it; the host runs ahead of the device.
        cuda = any(f.device.type == "cuda" for f in full)
        self.host_reads = torch.cuda.Event() if cuda else NullEvent()
        self.gathered = [u.persistent for u in plan.all_units]
        self.pending: dict[int, Handle] = {}
        self.order: list[int] = []  # forward gather order of block units, recorded in the first step
        self.recording = True
        self.peak_gathered = 0
        self._guard = ReleasedReadGuard(self)
        self._guard_depth = 0
        self._graph_pending = False
        self.internal = False
        self.wait_ready = None  # the overlapped step: wait_ready(u) returns once unit u's update is in
        self.gather_counts = [0] * len(plan.all_units)
        by_block: dict[str, list[int]] = {}
        for u in plan.all_units:
            if not u.persistent:
                for m in u.modules:
                    by_block.setdefault(m, []).append(u.index)
        self.block_units = {name: tuple(units) for name, units in by_block.items()}
        # Each trainable parameter's block (persistent small ones included), to know when a block's are all in.
        self._slot_block = blocks.slot_blocks(plan)
        self._trainable = {b: self._slot_block.count(b) for b in self.block_units}
        self._done: dict[str, int] = {}  # per block: trainable parameters whose gradient is in
        self.root_units = tuple(by_block.pop("", ()))
        self._forward_ok = False  # the model's forward returned (not raised): its END may be sent
        self._handles = [
            model.register_forward_pre_hook(self._root_pre_forward),
            model.register_forward_hook(self._forward_returned),
            model.register_forward_hook(self._root_post_forward, always_call=True),
        ]
        for name, module in model.named_modules():
            if name in by_block:
                units = tuple(by_block[name])
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(units)))
                self._handles.append(module.register_forward_hook(self._post_forward(units)))

    # -------------------------------------------------------------------------------------------- hooks
    def _forward_returned(self, module, args, output) -> None:
        self._forward_ok = True

    def _root_pre_forward(self, module, args) -> None:
        self._forward_ok = False
        if self._guard_depth == 0:
            self._guard.__enter__()
        self._guard_depth += 1
        for u in self.root_units:
            self.gather(u, backward=False)

    def _root_post_forward(self, module, args, output) -> None:
        if self._guard_depth > 0:  # (not entered if an earlier pre-hook raised)
            self._guard_depth -= 1
            if self._guard_depth == 0:
                self._guard.__exit__(None, None, None)
        if torch.is_grad_enabled():
            self._graph_pending = True  # a backward will need the root: it stays until release_all
        elif not self._graph_pending:  # evaluation, with no training graph waiting for its backward
            for u in self.root_units:
                self.release(u)
            if self._forward_ok and any(self.managed):  # (a forward that raised tells no peer it is done)
                self.check_end()  # no backward's check follows: a block one rank skipped is found here

    @property
    def in_backward(self) -> bool:
        return self.blocks.in_backward

    def _pre_forward(self, units: tuple[int, ...]):
        def hook(module, args):
            for u in units:
                self.gather(u, backward=self.in_backward)

        return hook

    def _post_forward(self, units: tuple[int, ...]):
        def hook(module, args, output):
            if self.in_backward:  # a recompute: the unit stays until its gradients are in
                return None
            for u in units:
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
            self.recording = False
            for u in units:
                self.gather(u, backward=True)

        return hook

    # ------------------------------------------------------------------------------------ gather/release
    def gather(self, u: int, backward: bool) -> None:
        self.internal = True  # the guard lets the gatherer's own work on released buffers through
        try:
            self._gather(u, backward)
        finally:
            self.internal = False

    def _gather(self, u: int, backward: bool) -> None:
        if self.managed[u] and not self.gathered[u]:
            self._start(u)
        handle = self.pending.pop(u, None)
        if handle is not None:
            handle.wait()
        if not backward and self.recording and u not in self.order and u not in self.root_units:
            self.order.append(u)
        self._prefetch_after(u, backward)
        self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())

    def _start(self, u: int) -> None:
        if (
            self.wait_ready is not None
        ):  # (blocking, not skipping: every rank starts the same gathers in order)
            self.wait_ready(u)
        self.gather_counts[u] += 1  # every rank must issue the same gathers (check_same_gathers)
        full = self.full[u]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self.gathered[u] = True
        if self.disk is not None and self.disk.holds(u):
            self.reading.append((u, self.disk.read(u)))
            self.pending[u] = _GatherFromDisk(self, u)
            return
        shard = self.shards[u]
        if shard.device != full.device:  # parameter offload: the shard comes up from host memory first
            shard = shard.to(full.device, non_blocking=True)
            self.host_reads.record()
        # every peer must be gathering this unit too (see CheckedGather)
        self.pending[u] = self.checked_gather(u, partial(self.comm.all_gather, shard, full, True, "gather"))

    def _prefetch_after(self, u: int, backward: bool) -> None:
        if self.recording or not self.prefetch_numel or u not in self.order:
            return
        seq = self.order[::-1] if backward else self.order
        ahead = seq[seq.index(u) + 1 :]
        budget = max(self.prefetch_numel, self._next_block_numel(u, ahead))
        for nxt in ahead:
            # Units already held count against the window too, or each gather would reach another
            # prefetch_bucket_size further and the gathered set would grow toward the whole model.
            budget -= self.plan.all_units[nxt].padded
            if budget < 0:
                break
            if not self.gathered[nxt]:
                self._start(nxt)

    def issue_disk_gathers(self, through: int) -> dict[int, tuple[Handle, ShardRead]]:
        """Issue the all-gathers of disk gathers, in the order they were started, up to unit `through`.

        A disk gather's all-gather waits for its shard's read, so it is issued late; but issued in the
        order the gathers were waited for, ranks would disagree (a block is released, and its prefetched
        neighbour waited for, when its last gradient arrives: data-dependent under MoE routing) and pair
        their all-gathers wrongly. The start order is the same on every rank, as it is for gathers from
        memory; each read stays referenced until its all-gather is done."""
        issued = {}
        while self.reading:
            v, read = self.reading.pop(0)
            shard = read.wait()
            gather = self.checked_gather(
                v, partial(self.comm.all_gather, shard, self.full[v], True, "gather")
            )
            issued[v] = (gather, read)
            if v == through:
                break
        return issued

    def _next_block_numel(self, u: int, ahead: list[int]) -> int:
        """Parameters on disk: the elements up to the end of the next block, which are read ahead whatever
        prefetch_bucket_size says (a block's read, ~0.45 GB at 3.4B, would otherwise stall the compute it is
        slower than; cost: one more block gathered). 0 when the parameters are in memory."""
        if self.disk is None:
            return 0
        blocks = {self.plan.all_units[u].modules[0]}
        numel = 0
        for nxt in ahead:
            blocks.add(self.plan.all_units[nxt].modules[0])
            if len(blocks) > 2:
                break
            numel += self.plan.all_units[nxt].padded
        return numel

    def release(self, u: int) -> None:
        if not self.managed[u] or not self.gathered[u]:
            return
        if u in self.root_units and self.in_backward:  # the root stays until backward has ended
            return
        self.internal = True
        try:
            handle = self.pending.pop(u, None)
            if handle is not None and not self.broken:  # (after a mismatch no peer answers: don't wait)
                handle.wait()
            self.full[u].untyped_storage().resize_(0)
            self.gathered[u] = False
        finally:
            self.internal = False

    def slot_done(self, slot: int) -> None:
        """Trainable parameter `slot` has its gradient (the reducer's callback, once per backward)."""
        block = self._slot_block[slot]
        self._done[block] = self._done.get(block, 0) + 1
        self._maybe_release(block)

    def _maybe_release(self, block: str) -> None:
        """Free a block (its frozen units included) once every trainable parameter in it has its gradient and
        the gradients of every input it was called with exist (blocks.py): backward needs none of its weights
        after that (a weight's own gradient comes from the node that used it, which has run by then; a frozen
        weight may still be needed to pass gradients on after its block's trainable parameters have theirs).
        """
        done = self._done.get(block, 0) >= self._trainable.get(block, 0)
        if done and self.blocks.open(block) == 0:
            for v in self.block_units.get(block, ()):
                self.release(v)

    def wait_host_reads(self) -> None:
        """Block until every upload of a host-resident shard issued so far has landed on the device."""
        self.host_reads.synchronize()

    def release_all(self) -> None:
        """Free every gathered unit: after backward, and before a step changes the shards."""
        self.blocks.reset()
        self._done.clear()
        self._graph_pending = False
        for u in range(len(self.full)):
            self.release(u)

    def check_same_gathers(self) -> None:
        """After a forward and after a backward: every rank must have gathered every unit as often as the
        others, or their all-gathers were paired with the wrong partners (a block run on some ranks only:
        data-dependent or random layer skipping). Two small all-reduces per micro-batch: per unit, the count
        and its square (all ranks agree exactly when N * sum(c^2) == sum(c)^2). On gloo the gathers' codes
        (check_end, check_codes) name a mismatch first; on NCCL the codes go over the gloo side group
        (collectives.Comm.side_checks) before each gather is issued, so the mismatch is named there too."""
        counts, self.gather_counts = self.gather_counts, [0] * len(self.full)
        if self.comm.world == 1:
            return
        self.check_end()
        sums = self.comm.sum_scalars([float(c) for c in counts] + [float(c * c) for c in counts])
        n = len(counts)
        for u in range(n):
            if self.comm.world * sums[n + u] != sums[u] ** 2:
                block = self.plan.all_units[u].modules[0] if self.plan.all_units[u].modules else f"unit {u}"
                raise UnsupportedModelError(
                    f"zero.stage 3: block '{block or 'the root'}' ran on some ranks and not on others in this "
                    f"micro-batch (rank {self.comm.rank} gathered it {counts[u]} time(s)); stage 3 needs every "
                    "rank to run the same blocks (no data-dependent or random layer skipping): use zero.stage 2"
                )

    def gathered_bytes(self) -> int:
        return sum(
            f.numel() * f.element_size()
            for u, f in enumerate(self.full)
            if self.managed[u] and self.gathered[u]
        )


class _GatherFromDisk:
    """A gather whose shard is still being read from its swap file: the read runs ahead (prefetch); the
    all-gather is issued, in start order, once this gather or a later one is waited for
    (UnitGatherer.issue_disk_gathers). The cost: the all-gather itself overlaps compute only as far as the
    gathers started before it; the disk read, the larger part, overlaps fully."""

    def __init__(self, gatherer: UnitGatherer, u: int):
        self.gatherer, self.u = gatherer, u
        self.issued: tuple[Handle, ShardRead] | None = None

    def wait(self) -> None:
        if self.issued is None:
            for v, issued in self.gatherer.issue_disk_gathers(self.u).items():
                # this one (already popped from pending by its waiter), or one started before it
                (self if v == self.u else self.gatherer.pending[v]).issued = issued
        self.issued[0].wait()
        self.issued[1].release()  # the all-gather has copied the shard: its buffer takes the next read
        self.issued = None
