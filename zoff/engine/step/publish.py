"""How a ZeroEngine's updated masters become the parameters the next forward uses: each piece of a master
into its live 16-bit shard, the parameter swap file or, under DPU on disk, that file's other slot, and the
all-gathers of the units gathered after a step.

Publication owns the engine's publication state: which optimizer step the live parameters are
(`published`), whether a delayed step wrote the parameter file's other slot (`slot_written`) and the pieces
it kept for the persistent units (`pending`). Only its own methods change them; the engine's step calls
`stepped` when an update is in, `flush` publishes a delayed one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoff.engine.comm.collectives import Comm, Handle
from zoff.engine.disk.param_swap import SwappedShards
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy
from zoff.engine.step.optimizer import ShardOptimizer


def on_host(shard: torch.Tensor, device: torch.device) -> bool:
    """Stage 3 parameter offload on a GPU: this shard lives in host memory, not on the device."""
    return shard.device.type == "cpu" and device.type != "cpu"


class Publication:
    """The updated masters into the live parameters (shards, swap files, full buffers), and what of that is
    done: the one owner of the engine's publication state."""

    def __init__(
        self, plan: PartitionPlan, policy: Policy, comm: Comm, shards: list[torch.Tensor],
        full: list[torch.Tensor], optimizer: ShardOptimizer, device: torch.device, *,
        param_disk: SwappedShards | None, next_params: SwappedShards | None,
        wait_host_reads: Callable[[], None] | None,
    ):  # fmt: skip
        self.plan, self.policy, self.comm, self.shards, self.full = plan, policy, comm, shards, full
        self.optimizer, self.device = optimizer, device
        self.param_disk, self.next_params = param_disk, next_params
        self.wait_host_reads = wait_host_reads  # parameter offload: a gather may still copy a host shard up
        self.published = 0  # the optimizer step whose parameters are live
        self.slot_written = False  # a delayed step wrote the parameter file's other slot: flush() flips it
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # DPU's kept pieces (delayed_piece)
        self.second: dict[int, list[tuple[int, torch.Tensor]]] = {}  # speculation's kept pieces, per unit

    # ------------------------------------------------------------------ speculation (speculate.py)
    def speculated_piece(self, u: int, lo: int, master: torch.Tensor) -> None:
        """(The speculation's thread.) A piece of unit u's speculative master, kept apart from everything the
        next forward reads: on the host tier its second buffer keeps it (nothing to do); parameters on disk,
        into the unit's other region (param_swap.write_second); else a copy in the live shard's dtype."""
        if self.optimizer.states.keeps_speculated_master:
            return
        if self.param_disk is not None and self.param_disk.holds(u):
            self.param_disk.write_second(u, lo, master)
            return
        self.second.setdefault(u, []).append((lo, master.to(self.shards[u].dtype, copy=True)))

    def commit(self, units: frozenset[int], handles: list[Handle]) -> None:
        """The committed units' parameters become live (their states were committed: States.commit), each
        unit's all-gather started after it; the kept pieces of the others are dropped."""
        states = self.optimizer.states
        if self.param_disk is not None and not states.keeps_speculated_master:
            self.param_disk.flip_units([u for u in units if self.param_disk.holds(u)])
        for u in sorted(units):
            if states.keeps_speculated_master:
                for k, lo, _ in states.spans(u):
                    with states.open(k, write_back=False) as (master, _, _):
                        self.piece(u, lo, master, True, handles)
            else:
                for lo, piece in self.second.get(u, ()):
                    self.piece(u, lo, piece, True, handles)
            self.piece(u, None, None, True, handles)
        self.second.clear()
        if self.param_disk is not None:
            self.param_disk.flush()  # (a discarded unit's second-region writes: landed, harmless)

    def stepped(self, delayed: bool) -> None:
        """The step's update is in (its parameters live), or `delayed`: DPU's update is in flight, writing its
        shards where the next forward does not read them (on disk), published by flush()."""
        self.slot_written = delayed and (self.param_disk is not None or self.next_params is not None)
        if not delayed:
            self.published = self.optimizer.step_count

    def flush(self) -> None:
        """Finish a delayed (DPU) optimizer step in flight and publish its parameters; otherwise a no-op."""
        if self.optimizer.step_count <= self.published:
            return
        self.optimizer.finish()  # (step() times this wait with the publication: last_flush_s)
        if not self.slot_written:
            self.publish_all()  # (each master read back where it is)
            return
        self.slot_written = False
        self.published = self.optimizer.step_count
        handles: list[Handle] = []
        if self.next_params is not None:  # the new shards, from their file into the live ones
            self._publish_from(self.next_params, handles)
            return
        # the delayed step wrote its shards on disk into the other slot and kept the rest (delayed_piece)
        self.param_disk.flip()
        pending, self.pending = self.pending, []
        for u, lo, piece in pending:
            self.piece(u, lo, piece, True, handles)
        for u in dict.fromkeys(u for u, _, _ in pending):
            self.piece(u, None, None, True, handles)
        for h in handles:
            h.wait()

    def _publish_from(self, shards: SwappedShards, handles: list[Handle]) -> None:
        """Every unit's new shard read from `shards` (the next unit's read in flight meanwhile) into its live
        shard, and the all-gathers after it."""
        shards.flush()
        n = len(self.plan.units)
        ahead = shards.read(0) if n else None
        for u in range(n):
            read, ahead = ahead, shards.read(u + 1) if u + 1 < n else None
            self.piece(u, 0, read.wait(), True, handles)
            read.release()
            self.piece(u, None, None, True, handles)
        for h in handles:
            h.wait()

    def delayed_piece(self, u: int, lo: int | None, master: torch.Tensor | None) -> None:
        """DPU's publication from its background step on the disk tier, a piece of unit u's new master at a
        time: with parameters in memory, into the new shards' file (next_params) that flush() reads back;
        stage 3 with parameters on disk, into the parameter file's other slot, which no gather reads until
        flush() flips it, the persistent units' pieces (small: their live shards are what the next forward
        reads) kept, cast, until flush() copies them in."""
        if lo is None:
            return
        if self.next_params is not None:  # parameters in memory: their own file (flush reads it back)
            self.next_params.write(u, lo, master)
        elif self.param_disk is None:
            return
        elif self.param_disk.holds(u):
            self.param_disk.write(u, lo, master, slot=self.param_disk.slot ^ 1)
        else:  # (the cast the copy into the shard would do: the same bits)
            self.pending.append((u, lo, master.to(self.shards[u].dtype, copy=True)))

    def publish_all(self) -> None:
        """Masters -> 16-bit shards -> all-gathered full buffers, for every unit."""
        self.published = self.optimizer.step_count
        self.pending, self.slot_written = [], False  # (a delayed step's output: superseded)
        handles: list[Handle] = []
        states, n = self.optimizer.states, len(self.plan.units)
        pieces = [(u, k, lo) for u in range(n) for k, lo, _ in states.spans(u)]
        for j, (u, k, lo) in enumerate(pieces):
            with states.open(k, write_back=False) as (master, _, _):  # read only
                self.piece(u, lo, master, True, handles)
            if j + 1 == len(pieces) or pieces[j + 1][0] != u:
                self.piece(u, None, None, True, handles)
        for h in handles:
            h.wait()
        if self.param_disk is not None:
            self.param_disk.flush()

    def piece(
        self, u: int, lo: int | None, master: torch.Tensor | None, copy_master: bool, handles: list[Handle],
        ordered: bool = True,
    ) -> None:  # fmt: skip
        """A piece of unit u's updated master (starting at element lo) into its live shard; with lo None, the
        unit is complete and its all-gather starts. `ordered`: later kernels wait for its upload (tier.publish)."""
        if lo is None:
            if self.policy.gathers_after_step(self.plan.units[u].persistent):
                handles.append(self.comm.all_gather(self.shards[u], self.full[u], async_op=True))
            return
        if self.param_disk is not None and self.param_disk.holds(u):
            self.param_disk.write(u, lo, master)  # parameter offload to nvme: back to the swap file
            return
        shard = self.shards[u][lo : lo + master.numel()]
        if master.data_ptr() == shard.data_ptr() or not copy_master:
            return  # fp32 stepping the shard in place, or the CPU kernel wrote the 16-bit shard itself
        if on_host(self.shards[u], self.device):  # parameter offload: a gather may still be copying it up
            self.wait_host_reads()
            shard.copy_(master)
        else:  # through the tier: asynchronous uploads on a GPU, which the gather waits for
            self.optimizer.tier.publish(master, shard, ordered)
