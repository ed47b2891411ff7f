"""The ZeRO engine: one code path for stages 0-3, which differ only in three choices made at construction.

stage 0  nothing partitioned: gradients all-reduced, every rank steps every parameter (DDP)
stage 1  optimizer state partitioned: gradients reduce-scattered, each rank steps its shard, params gathered
stage 2  + gradients partitioned: a unit's full gradient exists only until it has been reduce-scattered
stage 3  + parameters partitioned: units are gathered around the modules that use them (see gather.py)
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zoff.config import OptimConfig, ZeroConfig
from zoff.engine.comm.blocks import BlockTracker
from zoff.engine.comm.collectives import Comm, Handle
from zoff.engine.comm.gather import UnitGatherer
from zoff.engine.comm.reduce import GradReducer
from zoff.engine.disk.budget import host_budget_bytes, mem_total
from zoff.engine.disk.param_swap import next_params_file, param_file
from zoff.engine.disk.placement import DiskSplit, disk_split, subgroup_of
from zoff.engine.disk.tier import DiskTier
from zoff.engine.disk.traffic import master_served_units
from zoff.engine.engine_state import EngineState
from zoff.engine.materialize import FlatBuffers, prepare_model
from zoff.engine.policy import Policy, engine_plan
from zoff.engine.precision import DTYPES, LossScaler, RescaledGrads, clip_factor
from zoff.engine.report import EngineReports
from zoff.engine.speculation import (
    EngineSpeculation,
    local_ranks,
    second_slots_of,
    speculates,
    speculation_of,
)
from zoff.engine.staging import Staging, needs_staging
from zoff.engine.step.grad_store import GradShards, ResidentGrads
from zoff.engine.step.optimizer import ShardOptimizer, cpu_fused_kernel, step_runs, torch_fused_kernel
from zoff.engine.step.overlap import OverlappedStep
from zoff.engine.step.publish import Publication
from zoff.engine.step.speculate import may_commit
from zoff.engine.step.tiers import DeviceTier, HostTier


@dataclass(frozen=True)
class StepResult:
    grad_norm: float
    stepped: bool  # False when a loss or a gradient was non-finite on some rank: the step was skipped
    # the ranks whose loss (any micro-batch's) was non-finite, from the step's all-reduce; where every loss was
    # finite, those whose gradient shard was (a NaN reaches every shard it is reduced into): `nonfinite` says
    nonfinite_ranks: tuple[int, ...] = ()
    nonfinite: str = ""  # "loss", "gradient", or "" (the step was finite)
    scale_lowered: bool = False  # fp16: the overflow brought the loss scale down (it may cure the next step)


class ZeroEngine(EngineReports, EngineState, EngineSpeculation):
    """Stages 0-3 on one code path. Composed of parts that each own one concern (the reducer, the gatherer,
    the optimizer on its tier, the publication); EngineReports and EngineState are the reading and the
    checkpoint halves of the same class, kept in their own modules."""

    def __init__(
        self,
        model: nn.Module,
        zero: ZeroConfig,
        optim: OptimConfig,
        *,
        precision: str = "fp32",
        grad_clip: float = 0.0,
        grad_accum: int = 1,
        comm: Comm | None = None,
        device: torch.device | None = None,
        host_reserved: int = 0,
    ):
        self.comm = comm or Comm()
        self.stage, self.zero, self.grad_clip = zero.stage, zero, grad_clip
        self.dtype, self.device = DTYPES[precision], device or torch.device("cpu")
        policy = self.policy = Policy.of(zero)
        self.precision, self.grad_accum = precision, grad_accum
        self.keep_full_grads = policy.keeps_full_grads  # full gradients accumulate in persistent flat buffers
        self.accum_dtype = torch.float32 if policy.shard_accum_fp32(grad_accum > 1) else self.dtype
        self.rank = policy.rank_in_partition(self.comm.rank)  # stage 0: one partition that every rank owns
        self.plan = engine_plan(model, self.stage, self.comm.world, zero)
        self.host_reserved = host_reserved
        self.split = self._disk_split(host_reserved)
        self.model, self.deferred = prepare_model(model, self.device, self.dtype)
        self.scaler = LossScaler(enabled=precision == "fp16")
        self.offload, self.offload_params = policy.offloads_optimizer, policy.offloads_params
        self.second = second_slots_of(self)  # the disk tier's speculated units (before any file is made)
        # stage 3 parameters on disk (a second region for each speculated unit)
        self.param_disk = param_file(zero, policy, self.plan, self.dtype, self.second.units)
        self.next_params = next_params_file(zero, policy, self.plan, self.dtype)  # DPU, the parameters in RAM
        flat = FlatBuffers.build(
            model, self.plan, self.comm, stage=self.stage, rank=self.rank, dtype=self.dtype, device=self.device,
            deferred=self.deferred, keep_full_grads=self.keep_full_grads, host_shards=self.offload_params, pin_host_shards=zero.offload_param.pin_memory, disk=self.param_disk,
        )  # fmt: skip
        self._params, self.full, self.shard_params, self.gfull = (
            flat.params,
            flat.full,
            flat.shards,
            flat.gfull,
        )
        self.cpu_threads = torch.get_num_threads()
        self.optimizer = self._build_optimizer(optim, grad_clip > 0 or precision == "fp16")
        self.staging = self.optimizer.tier.staging  # offload on a GPU: bounded pinned buffers (staging.py)
        if self.param_disk is not None:  # units the budget keeps in RAM gather from their masters: no disk
            self.param_disk.from_master = self._master_casts()
        self.grads = self._grad_shards(flat.gshard)
        self.blocks = BlockTracker(model, tuple(zero.block_classes))
        self.gatherer = None
        if policy.shards_params:
            self.gatherer = UnitGatherer(
                model, self.plan, self.comm, self.full, self.shard_params, zero.prefetch_bucket_size, self.blocks,
                disk=self.param_disk,
            )  # fmt: skip
        self.reducer = GradReducer(
            self.plan, self.comm, policy, self.gfull, self.grads, dtype=self.dtype, device=self.device,
            overlap=zero.overlap_comm, on_slot_done=self.gatherer.slot_done if self.gatherer else None,
            slot_blocks=self.blocks.slot_blocks(self.plan),
        )  # fmt: skip
        self.blocks.listeners.append(self.reducer.block_done)
        self.publication = Publication(
            self.plan, policy, self.comm, self.shard_params, self.full, self.optimizer, self.device,
            param_disk=self.param_disk, next_params=self.next_params,
            wait_host_reads=self.gatherer.wait_host_reads if self.gatherer else None,
        )  # fmt: skip
        self.overlap = self._overlapped_step()
        self.speculation = speculation_of(self)  # None: this rank never speculates
        # every rank alike (the config, the device's kind, the tier): whether steps carry the units' flags
        self.speculates = self.offload and speculates(
            zero.offload_optimizer, self.device, self.optimizer.tier.kind
        )
        self.skipped_steps = [0] * len(self.plan.slots)  # steps each parameter had no gradient anywhere
        self.nonfinite_steps = 0  # steps skipped (any precision) by this engine
        self._loss_ok: torch.Tensor | None = None  # every micro-batch's loss of the window finite (on device)
        self.last_step_comm: dict[str, int] = {}
        self.last_step_times: dict[str, float] = {}
        self.last_flush_s = 0.0
        for slot, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self.reducer.hook(slot))
        self.zero_grad()

    # --------------------------------------------------------------------------------------- set-up
    def _disk_split(self, host_reserved: int) -> DiskSplit:
        """The disk tier's host budget: what of its states (and gradients) stays in RAM (a pure value);
        host_reserved is the rest of the rank's host memory, which the budget holds too (the trainer passes
        what `zoff estimate` computes: planning.memory.rank_split)."""
        budget = host_budget_bytes(self.zero.offload_optimizer, mem_total(), local_ranks(self.comm.world))
        return disk_split(
            self.plan, self.policy, self.zero, self.precision, self.grad_accum > 1, budget, host_reserved,
            clipping=self.grad_clip > 0,
        )  # fmt: skip

    def _master_casts(self) -> dict:
        """Under parameter offload to nvme, the units whose states the host budget keeps in RAM, each with
        the cast of its master that its gathers read instead of the parameter file (traffic.master_served_units)."""
        oo = self.zero.offload_optimizer
        units = master_served_units(
            self.plan, self.policy, subgroup_of(self.zero), self.split, oo.delay_update
        )
        return {u: self.optimizer.states.master_cast(u) for u in units}

    def _grad_shards(self, views: list[torch.Tensor]) -> GradShards:
        """The reduced gradient shards, in the tier that holds the optimizer's states (grad_store.py); stages 0-1
        without offload keep them as `views` of the full gradient buffers."""
        if self.keep_full_grads:
            return ResidentGrads(views, on_device=True)
        return self.optimizer.tier.grad_store(
            [u.shard for u in self.plan.units], self.accum_dtype, self.device
        )

    def _overlapped_step(self) -> OverlappedStep | None:
        """The overlapped step (step/overlap.py): the walk runs while the next forward does, which waits per unit
        (the config allows it with an offloaded optimizer only; `zero: auto` may choose the policy later)."""
        if not (self.zero.offload_optimizer.overlap_step and self.gatherer is not None and self.offload):
            return None
        step = OverlappedStep(
            self.plan, self.policy, self.comm, self.optimizer, self.publication, self.shard_params, self.full
        )
        self.gatherer.wait_ready = step.wait_unit
        return step

    def _build_optimizer(self, optim: OptimConfig, rescales: bool) -> ShardOptimizer:
        """The partition's optimizer on its storage tier: the device's (torch's fused AdamW), or under
        optimizer offload host memory or the disk tier's swap file (zoff's fused CPU Adam, DPU optional)."""
        shards = self.shard_params[: len(self.plan.units)]  # trainable units: frozen ones have no state
        runs = [self.plan.decay_runs(u.index, self.rank) for u in self.plan.units]
        oo = self.zero.offload_optimizer
        if not self.offload:
            return ShardOptimizer(shards, runs, optim, DeviceTier(), torch_fused_kernel)
        staging = (
            Staging(oo.staging_mb << 20, self.device, pin=oo.pin_memory)
            if needs_staging(self.device)
            else None
        )
        on_host = self.device.type == "cpu"
        # what step() hands the optimizer: rescaled (clipped, unscaled) gradients are fp32, others as reduced
        grad_dtype = torch.float32 if rescales or self.accum_dtype == torch.float32 else self.dtype
        # DPU's step reads a snapshot: the next backward rewrites the shards (on disk: the other gradient file)
        copy_grads = oo.delay_update and not (oo.device == "nvme" and self.split.grads_on_disk)
        if oo.device == "nvme":
            tier = DiskTier(
                staging, grad_dtype, copy_grads, Path(oo.nvme_path), oo.io.threads, oo.io.request_mb,
                piece=subgroup_of(self.zero), params=self.param_disk, grads_on_disk=self.split.grads_on_disk,
                resident=self.split.resident, delayed=oo.delay_update, speculated=self.second.pieces,
            )  # fmt: skip
        else:
            tier = HostTier(
                staging, grad_dtype,
                # fp32 on a host-only machine needs no master copy, unless DPU must keep the live params apart
                alias_masters=self.dtype == torch.float32 and on_host and not oo.delay_update,
                copy_grads=copy_grads,
            )  # fmt: skip
            tier.speculate = speculates(oo, self.device, "cpu")
        return ShardOptimizer(
            shards, runs, optim, tier, cpu_fused_kernel, delay_update=oo.delay_update,
            delay_warmup=oo.delay_update_warmup, threads=self.cpu_threads, device=self.device,
        )  # fmt: skip

    # ---------------------------------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor, sync: bool = True, lr: float | None = None) -> None:
        """Backward of one micro-batch; `sync` on the last micro-batch of a step averages the gradients; `lr`,
        the coming step's, lets it speculate the step's update (speculate.py)."""
        # An overlapped step's walk reads the gradient shards this backward rewrites; DPU's reads a snapshot
        # (or, on disk, the other gradient file) and goes on beside backward too.
        if not self.optimizer.delay:
            self.optimizer.finish()
        if self.param_disk is not None:
            self.param_disk.drop_held()  # what the forward did not take from the walk's write-backs
        self.reducer.begin(sync)
        if self.gatherer is not None:
            self.gatherer.check_same_gathers()  # the forward's gathers, before backward's could hang on them
        self.blocks.in_backward = True
        speculating = self._begin_speculation(lr) if sync and not self.optimizer.running else False
        if sync and not self.optimizer.running and not speculating:
            self.optimizer.states.prefetch()  # the disk tier reads the step's first pieces while backward computes
        at_start = self._disk_bytes_now() if sync else None
        # read at the step (one wait for the device a step, not one a micro-batch)
        ok = torch.isfinite(loss.detach()).all()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        except BaseException:
            self.reducer.settle()  # landings already queued finish before the error leaves backward
            self._discard_speculation()
            raise
        finally:
            if self.gatherer is not None:
                self.gatherer.release_all()  # no gathered copy outlives backward: the step changes the shards
            self.blocks.reset()
        self.reducer.end_backward()  # autograd is done: every hook that will fire has fired
        self._backward_disk(at_start)
        if self.gatherer is not None:
            self.gatherer.check_same_gathers()

    # -------------------------------------------------------------------------------------------- step
    def step(self, lr: float) -> StepResult:
        """Unscale, check overflow, clip by the global norm, update this rank's shard, share the new params.

        The update runs one of two ways, chosen first: the overlapped step's walk in the background, the next
        forward waiting per unit (OverlappedStep.update); or here, each unit published as it is stepped
        (_update), where under DPU the update of this step runs in the background and the previous one is
        published first, so the next forward sees parameters one step stale (ZeRO-Offload's delayed
        parameter update). _end_step ends every step.
        """
        update = self._update if self.overlap is None else self.overlap.update
        try:
            self.reducer.check()  # a failed gradient landing (landing.py): never a step on a window missing one
        except BaseException:
            self._discard_speculation()
            raise
        t_wait = time.perf_counter()
        self.optimizer.finish()  # (an overlapped step's walk is joined already, by backward)
        self.flush()
        self.last_flush_s = time.perf_counter() - t_wait  # DPU: the wait for the last step's walk
        if self.gatherer is not None:
            self.gatherer.release_all()
        if self.param_disk is not None:
            self.param_disk.trim()  # the gathers' kept read buffers: not held through the step
        # Unscale with the scale these gradients were computed with; it may grow only afterwards (GradScaler).
        coef = base = 1.0 / self.scaler.scale
        total_sq, bad, unused, flags = self._global_norm_sq(self._speculation_flags(lr, base))
        if bad:  # never applied, at any precision (fp16's scaler also scales down); every rank alike
            self._commit_speculation(False, unused, flags)  # (a failed worker is heard all the same)
            self._discard_speculation(overflowed=True)
            what, ranks = bad
            # fp16's overflow, which a lower scale may cure: the scale could still come down (it stops at 1)
            lowered = self.scaler.enabled and what == "gradient" and self.scaler.scale > 1.0
            # inf where a gradient was (+inf and -inf shards sum to nan): as the records always showed
            finite = what == "loss" and math.isfinite(total_sq)  # (a non-finite loss over finite gradients)
            norm = math.sqrt(total_sq) / self.scaler.scale if finite else math.inf
            if self.scaler.enabled:
                self.scaler.update(overflow=True)
            self.nonfinite_steps += 1
            skipped = StepResult(norm, False, ranks, what, scale_lowered=lowered)
            return self._end_step(skipped, times={"optimizer_s": 0.0, "publish_s": 0.0})
        norm = math.sqrt(total_sq) / self.scaler.scale
        self.scaler.update(overflow=False)
        factor = clip_factor(norm, self.grad_clip)
        if self.grad_clip > 0:
            coef *= factor
        runs = self._step_runs(unused)
        # speculation: commit only where the factor is exactly 1 (NaN fails it) and nothing overflowed
        committed = self._commit_speculation(may_commit(factor, False), unused, flags)
        # the tier converts what its kernel needs (the CPU kernel reads 16-bit directly)
        delayed = self.overlap is None and self.optimizer.next_step_delayed
        grads = RescaledGrads(self.grads.for_step(delayed), coef, fused=self.optimizer.fuses_grad_scale)
        t0 = time.perf_counter()
        times = update(grads, lr, runs, t0, committed)
        return self._end_step(StepResult(norm, stepped=True), times)

    def _update(
        self, grads: RescaledGrads, lr: float, runs: list | None, t0: float, skip: frozenset[int]
    ) -> dict[str, float]:
        """The update on this thread (DPU's in the background, published by the next flush); its times."""
        # the fused CPU kernel may have written the 16-bit shards in its own pass
        copy = not self.optimizer.writes_live_shards
        handles: list[Handle] = []
        # Each unit's all-gather starts as soon as that unit is stepped, overlapping the rest of the update.
        publish = lambda u, lo, master: self.publication.piece(u, lo, master, copy, handles)  # noqa: E731
        last_walk = self.optimizer.last_background_s  # (DPU: the walk just joined, before the next starts)
        delayed = self.optimizer.step(
            grads, lr, on_unit=publish, runs=runs, delayed_on_unit=self.publication.delayed_piece, skip=skip
        )
        t1 = time.perf_counter()
        for h in handles:
            h.wait()
        if self.param_disk is not None:
            self.param_disk.flush(live_only=True)  # the next forward reads the shards written back
            self.param_disk.trim()  # the write-backs' kept buffers: not held through the next forward
        # (last: a wait above that raises leaves the step unpublished, and a later flush() publishes it)
        self.publication.stepped(delayed)  # True: a delayed (DPU) update runs on, published next step
        times = {"optimizer_s": t1 - t0, "publish_s": time.perf_counter() - t1}
        if self.optimizer.delay:  # DPU: the last walk (beside this forward and backward) and the wait for it
            times |= {"last_walk_s": last_walk, "dpu_wait_s": self.last_flush_s}
        return times

    def _end_step(self, result: StepResult, times: dict[str, float] | None) -> StepResult:
        """Where every step ends: its times (None: a skipped step keeps the last ones) with its swap I/O since
        zero_grad (the forward's gathers on), and its collectives' elements."""
        if times is not None:
            now = self._disk_counters()
            self.last_step_times = times | {k: v - self._disk_at_start.get(k, 0) for k, v in now.items()}
            self.last_step_times |= self._step_extras()
        self.last_step_comm = dict(self.comm.stats.elements)
        return result

    def _global_norm_sq(self, extra: list[float]) -> tuple[float, tuple | None, list[int], list[float]]:
        """(the global squared gradient norm, what was non-finite where (None: nothing), slots no rank gave a
        gradient, the sums of `extra`) in one all-reduce (`extra`: the speculation's per-unit flags,
        speculation.py). Each rank's flags (its loss, its gradient shards) sit in its own slots, so every rank
        names the same ranks.

        Each unit's norm was folded in as its shard landed (grad_store.py): no second pass over the shards."""
        world, rank = self.comm.world, self.comm.rank
        local_sq, bad = 0.0, [0.0] * (2 * world)  # (losses, then gradient shards)
        for sq in self.grads.norms_sq():
            local_sq += sq
            if not math.isfinite(sq):
                bad[world + rank] = 1.0
        loss_ok, self._loss_ok = self._loss_ok, None
        if loss_ok is not None and not bool(loss_ok):
            bad[rank] = 1.0
        used = [1.0 if x else 0.0 for x in self.reducer.used]
        scalars = [local_sq, *bad, *used, *extra]
        if world > 1:
            scalars = self.comm.sum_scalars(scalars)
        # stage 0's gradients are already all-reduced: every rank holds the whole squared norm
        total_sq = local_sq if self.policy.all_reduces else scalars[0]
        w = 1 + 2 * world
        losses = tuple(r for r, x in enumerate(scalars[1 : 1 + world]) if x != 0)
        grads = tuple(r for r, x in enumerate(scalars[1 + world : w]) if x != 0)
        bad_at = ("loss", losses) if losses else ("gradient", grads) if grads else None
        flags, sums = scalars[w : w + len(used)], scalars[w + len(used) :]
        return total_sq, bad_at, [slot for slot, n in enumerate(flags) if n == 0], sums

    def _step_runs(self, unused: list[int]) -> list | None:
        """What this step updates (None: every parameter at this step's count); see optimizer.step_runs."""
        if not unused and not any(self.skipped_steps):
            return None
        for slot in unused:
            self.skipped_steps[slot] += 1
        return step_runs(self.plan, self.rank, set(unused), self.skipped_steps, self.optimizer.step_count + 1)

    @property
    def gshard(self) -> list[torch.Tensor]:
        """The resident gradient shards (empty when they live on disk)."""
        return self.grads.shards if self.grads.resident else []

    @property
    def masters(self) -> list[torch.Tensor] | None:
        """The resident fp32 masters (None on the disk tier: read them with optimizer.read); a background
        update in flight (DPU's, the overlapped walk) is joined first, a speculation's worker stopped."""
        self.stop_speculation()
        self.optimizer.finish()
        return self.optimizer.masters

    def flush(self) -> None:
        """Finish a delayed (DPU) optimizer step in flight and publish its parameters; otherwise a no-op."""
        self.publication.flush()

    def zero_grad(self) -> None:
        """Start an accumulation window: full-gradient buffers (stages 0-1 without offload) are zeroed,
        gradient shards are overwritten next time."""
        self._discard_speculation()  # (only if a backward's speculation found no step)
        self._loss_ok = None  # (a window whose backward raised never reached its step)
        for g in self.gfull:
            g.zero_()
        for p in self._params:
            p.grad = None  # the hooks move every gradient into the engine's buffers at once
        self.reducer.zero_grad()
        self.grads.begin_window()
        self.comm.stats.reset()
        self._disk_at_start = self._disk_counters()

    def close(self) -> None:
        """Release what outlives the process's memory: the disk tier's swap files (removed at a clean exit)."""
        try:
            self._discard_speculation()  # (a worker still running: stopped before its files close)
            self.optimizer.close()  # (re-raises a background step's error: the other files close all the same)
        finally:
            self.reducer.close()  # the landing thread, before the gradient file it writes closes
            # each file closes (and is removed) even where another's close raised a disk's I/O error
            with contextlib.ExitStack() as files:
                for f in (self.grads, self.param_disk, self.next_params):
                    if f is not None:
                        files.callback(f.close)
