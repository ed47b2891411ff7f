"""What a ZeroEngine reports about itself: memory held per category against the policy table's plan, pinned
bytes, per-step disk I/O, and the stats the trainer logs. A mixin, so the engine module keeps to the
training path; every method reads only the engine's own attributes."""

from __future__ import annotations

from zoff.engine.disk.placement import (
    grad_disk_bytes,
    next_params_bytes,
    optimizer_disk_bytes,
    param_disk_bytes,
    subgroup_of,
)
from zoff.engine.footprint import frozen_param_bytes, model_states
from zoff.engine.step.publish import on_host


class EngineReports:
    def _disk_bytes_now(self) -> tuple[float, float]:
        """(read, written) bytes of every swap file of this rank so far."""
        c = self._disk_counters()
        total = lambda end: sum(v for k, v in c.items() if k.endswith(end))  # noqa: E731
        return total("_read_bytes"), total("_written_bytes")

    def _backward_disk(self, start: tuple[float, float] | None) -> None:
        """The last backward's swap I/O (`start`: the counters as it began), for the step's record: what the
        speculation moved while backward computed (the disk's busy share of backward, scripts/bench_speculation.py)."""
        if start is not None:
            read, written = self._disk_bytes_now()
            self._backward_io = {"backward_disk_read_bytes": read - start[0],
                                 "backward_disk_written_bytes": written - start[1]}  # fmt: skip

    def _step_extras(self) -> dict[str, float]:
        """Per-step record fields beside the times: the last backward's disk bytes; the speculation's units."""
        out = dict(getattr(self, "_backward_io", {}))
        if self.speculation is not None:
            last = self.speculation.last
            out |= {"spec_speculated_units": last.get("speculated", 0),
                    "spec_committed_units": last.get("committed", 0), "spec_units": len(self.plan.units)}  # fmt: skip
        return out

    def _disk_counters(self) -> dict[str, float]:
        """This rank's swap-file I/O so far, per file: bytes read and written, seconds blocked waiting."""
        files = {
            "optimizer": self.optimizer.states.files,
            "params": [f.file for f in (self.param_disk, self.next_params) if f is not None],
            "grads": self.grads.files,  # the gradient swap file(s) (disk/grad_swap.DiskGrads)
        }
        out: dict[str, float] = {}
        for name, fs in files.items():
            if fs:
                out |= {f"disk_{name}_read_bytes": sum(f.read_bytes for f in fs),
                        f"disk_{name}_written_bytes": sum(f.written_bytes for f in fs),
                        f"disk_{name}_wait_s": sum(f.wait_s for f in fs)}  # fmt: skip
        if self.param_disk is not None:  # gathers waiting for shards, apart from the step's write-backs
            out["disk_params_read_wait_s"] = self.param_disk.file.read_wait_s
        return out

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds per category; `cpu_*` is what offload keeps in host memory.

        buffers are the transient peaks (reduce buckets, stage-3 gathered units).
        """
        # (meta tensors stand for shards on disk: no memory)
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None and not t.is_meta)  # noqa: E731
        if self.policy.shards_params:
            persistent = [f for u, f in zip(self.plan.units, self.full) if u.persistent]
            shards = [t for u, t in zip(self.plan.units, self.shard_params) if not u.persistent]
            offloaded = shards if self.offload_params else []
            params = nbytes(persistent) + nbytes(shards) - nbytes(offloaded)
        else:
            params, offloaded = nbytes(self.full), []
        # the gradient shards in the optimizer's tier (grad_store.py): the device only without offload
        grads = nbytes(self.gfull) if self.keep_full_grads else self.grads.device_bytes()
        opt = self.optimizer.resident_bytes()
        gathered = self.gatherer.peak_gathered if self.gatherer else 0
        whole = set(self.plan.frozen)
        frozen = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if n in whole)
        frozen_shards = nbytes(self.shard_params[len(self.plan.units) :])  # stage 3's (none on disk: meta)
        if self.offload_params:  # with the trainable shards in host memory
            offloaded = [*offloaded, *self.shard_params[len(self.plan.units) :]]
        else:
            frozen += frozen_shards
        host_grads = self.optimizer.tier.buffer_bytes() + self.grads.host_bytes()  # (+ DPU's snapshot)
        on_device = self.optimizer.tier.kind == "device"
        on_disk = self.optimizer.states.disk_bytes()
        return {
            "params": params,
            "grads": grads,
            "optimizer_states": opt if on_device else 0,
            "buffers": self.reducer.peak_bucket_bytes + self.comm.scratch.peak_bytes + gathered,
            "frozen_params": frozen,
            "cpu_params": nbytes(offloaded),
            "cpu_grads": host_grads,
            "cpu_optimizer_states": 0 if on_device else opt,
            "cpu_staging": self.staging.nbytes if self.staging is not None else 0,
            "disk_optimizer_states": on_disk,
            "disk_params": sum(f.disk_bytes() for f in (self.param_disk, self.next_params) if f is not None),
            "disk_grads": self.grads.disk_bytes(),
        }

    def planned_memory(self) -> dict[str, int]:
        """memory_report()'s model-state keys as the policy table predicts them (footprint.model_states, the very
        function `zoff estimate` calls): the start-up plan prints these beside what was allocated."""
        frozen = frozen_param_bytes(self.model, self.plan, self.precision, self.policy)
        gpu, cpu = model_states(
            self.plan, self.policy, self.precision, frozen_bytes=frozen, device_type=self.device.type,
            fp32_grad_staging=self.grad_clip > 0 or self.precision == "fp16",
            delay_update=self.zero.offload_optimizer.delay_update, accumulating=self.grad_accum > 1,
            subgroup=subgroup_of(self.zero), split=self.split,
        )  # fmt: skip
        delayed = self.zero.offload_optimizer.delay_update
        disk = {
            # (with the speculation's second slots: disk/second_slots.py)
            "disk_optimizer_states": optimizer_disk_bytes(self.plan, self.policy) + self.second.state_bytes,
            "disk_params": param_disk_bytes(self.plan, self.policy, self.precision, delayed)
            + self.second.param_bytes
            + next_params_bytes(self.plan, self.policy, self.precision, delayed),
            "disk_grads": grad_disk_bytes(
                self.plan, self.policy, self.split, self.grad_accum > 1, self.precision, delayed
            ),
        }
        return {**gpu, **{f"cpu_{k}": v for k, v in cpu.items()}, **disk}

    def pinned_bytes(self) -> int:
        """Page-locked host memory this rank holds: the staging buffers and pinned offloaded parameter shards."""
        shards = [t for t in self.shard_params if on_host(t, self.device) and t.is_pinned()]
        staged = self.staging.pinned_bytes if self.staging is not None else 0
        return staged + sum(t.numel() * t.element_size() for t in shards)

    def stats(self) -> dict:
        return {
            "stage": self.stage,
            "world_size": self.comm.world,
            "comm_elements": dict(self.last_step_comm),  # of the last step: zero_grad through step
            "comm_elements_total": sum(self.last_step_comm.values()),
            "peak_bucket_bytes": self.reducer.peak_bucket_bytes,
            "grad_reduction": self.reducer.mode,
            "late_corrections": self.reducer.corrections,  # reductions repeated for late gradients, all steps
            "skipped_steps": self.nonfinite_steps,  # (fp16's overflows too; the scaler's own count is in its state)
            "params": self.plan.numel,
            # stage 3: gathered once per step (forward through backward), not once for each
            "root_params": sum(u.numel for u in self.plan.units if u.modules == ("",) and not u.persistent),
            "units": len(self.plan.units),
            "loss_scale": self.scaler.scale,
            "offload_optimizer": self.offload,
            "cpu_adam": _cpu_adam_backend() if self.offload else None,
            "cpu_step_threads": self.cpu_threads,
            "last_step_times": {**self.last_step_times, "dpu_wait_s": self.last_flush_s},
            # run totals of the speculation (steps, speculated, committed, tainted units); None: it never ran
            "speculation": dict(self.speculation.counts) if self.speculation is not None else None,
        }


def _cpu_adam_backend() -> str:
    from zoff.optim import backend_info

    info = backend_info()
    return f"{info.get('backend')} ({info.get('simd', '?')})"
