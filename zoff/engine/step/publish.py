"""How a ZeroEngine's updated masters become the parameters the next forward uses: each piece of a master
into its live 16-bit shard, the parameter swap file or, under DPU on disk, that file's other slot, and the
all-gathers of the units gathered after a step. A mixin, as EngineReports is: it reads only the engine's own
attributes (plan, policy, shards, optimizer, param_disk, comm), and the engine's step and checkpoint paths
call it.
"""

from __future__ import annotations

import torch

from zoff.engine.collectives import Handle


class ShardPublishing:
    def flush(self) -> None:
        """Finish a delayed (DPU) optimizer step in flight and publish its parameters; otherwise a no-op."""
        if self.optimizer.step_count > self._published:
            self.optimizer.finish()  # (step() times this wait with the publication: last_flush_s)
            if not self._slot_written:
                self._publish_params()  # (each master read back where it is)
                return
            self._slot_written = False
            self._published = self.optimizer.step_count
            handles: list[Handle] = []
            if self.next_params is not None:  # the new shards, from their file into the live ones
                self._publish_from(self.next_params, handles)
                return
            # the delayed step wrote its shards on disk into the other slot and kept the rest (_publish_next)
            self.param_disk.flip()
            pending, self._pending = self._pending, []
            for u, lo, piece in pending:
                self._publish(u, lo, piece, True, handles)
            for u in dict.fromkeys(u for u, _, _ in pending):
                self._publish(u, None, None, True, handles)
            for h in handles:
                h.wait()

    def _publish_from(self, shards, handles: list[Handle]) -> None:
        """Every unit's new shard read from `shards` (a param_swap.SwappedShards, the next unit's read in
        flight meanwhile) into its live shard, and the all-gathers after it."""
        shards.flush()
        n = len(self.plan.units)
        ahead = shards.read(0) if n else None
        for u in range(n):
            read, ahead = ahead, shards.read(u + 1) if u + 1 < n else None
            self._publish(u, 0, read.wait(), True, handles)
            read.release()
            self._publish(u, None, None, True, handles)
        for h in handles:
            h.wait()

    def _publish_next(self, u: int, lo: int | None, master: torch.Tensor | None) -> None:
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
            self._pending.append((u, lo, master.to(self.shard_params[u].dtype, copy=True)))

    def _publish_params(self) -> None:
        """Masters -> 16-bit shards -> all-gathered full buffers, for every unit."""
        self._published = self.optimizer.step_count
        self._pending, self._slot_written = [], False  # (a delayed step's output: superseded)
        handles: list[Handle] = []
        states, n = self.optimizer.states, len(self.plan.units)
        pieces = [(u, k, lo) for u in range(n) for k, lo, _ in states.spans(u)]
        for j, (u, k, lo) in enumerate(pieces):
            with states.open(k, write_back=False) as (master, _, _):  # read only
                self._publish(u, lo, master, True, handles)
            if j + 1 == len(pieces) or pieces[j + 1][0] != u:
                self._publish(u, None, None, True, handles)
        for h in handles:
            h.wait()
        if self.param_disk is not None:
            self.param_disk.flush()

    def _publish(
        self, u: int, lo: int | None, master: torch.Tensor | None, copy_master: bool, handles: list[Handle]
    ) -> None:
        """A piece of unit u's updated master (starting at element lo) into its live shard; with lo None, the
        unit is complete and its all-gather starts."""
        if lo is None:
            if self.policy.gathers_after_step(self.plan.units[u].persistent):
                handles.append(self.comm.all_gather(self.shard_params[u], self.full[u], async_op=True))
            return
        if self.param_disk is not None and self.param_disk.holds(u):
            self.param_disk.write(u, lo, master)  # parameter offload to nvme: back to the swap file
            return
        shard = self.shard_params[u][lo : lo + master.numel()]
        if master.data_ptr() == shard.data_ptr() or not copy_master:
            return  # fp32 stepping the shard in place, or the CPU kernel wrote the 16-bit shard itself
        if self._host_shard(u):  # parameter offload: a gather may still be copying this shard up
            self.gatherer.wait_host_reads()
            shard.copy_(master)
        else:  # through the tier: asynchronous uploads on a GPU, which the gather waits for
            self.optimizer.tier.publish(master, shard)

    def _host_shard(self, u: int) -> bool:
        """Stage 3 parameter offload on a GPU: unit u's shard lives in host memory, not on the device."""
        return self.shard_params[u].device.type == "cpu" and self.device.type != "cpu"
