"""ZeRO-Offload: the partition's optimizer state lives in host memory and is stepped by zoff's fused CPU Adam.

Per step and rank the device<->host traffic is the minimum the ZeRO-Offload paper gives: the reduced gradient
shard down (2 B/param in 16-bit) and the updated 16-bit parameter shard up. Host buffers are allocated once
and reused every step; they stay pageable, and the copies go through a few pinned staging buffers (staging.py). On a CPU-only machine the "device" is the host: the
copies vanish (host buffers alias the device shards) and the same code runs.

Delayed parameter update (DPU): the CPU step of step i runs in a background thread while the next
forward/backward proceeds with parameters one step stale; `finish()` joins it and the engine publishes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from zoff.config import OffloadOptimizerConfig, OptimConfig
from zoff.engine.optimizer import Run, StepRun, all_runs
from zoff.engine.staging import Staging
from zoff.optim import cpu_adam_step


def host_buffer(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor shaped like `like`; pinned when a GPU will copy to/from it (page-locked, so DMA-able)."""
    pin = pin and torch.cuda.is_available()
    try:
        return torch.zeros(like.shape, dtype=dtype, device="cpu", pin_memory=pin)
    except RuntimeError as e:  # name the host buffer: a pinned-memory failure is not a device OOM
        nbytes = like.numel() * torch.empty(0, dtype=dtype).element_size()
        raise RuntimeError(
            f"zoff: cannot allocate {'pinned ' if pin else ''}host buffer of {nbytes:,} bytes: {e}"
        ) from e


class OffloadAdam:
    """Adam(W) over host fp32 master shards with the fused CPU kernel; optional delayed update in a thread."""

    def __init__(
        self,
        shard_params: list[torch.Tensor],
        runs: list[list[Run]],
        optim: OptimConfig,
        offload: OffloadOptimizerConfig,
        alias_masters: bool,
        threads: int,
        grad_dtype: torch.dtype,
        staging: Staging | None = None,
    ):
        self.cfg, self.runs, self.threads = optim, runs, threads
        self.delay = offload.delay_update
        self.warmup = offload.delay_update_warmup
        self.staging = staging  # device <-> host transfers (GPU); None: shards and states share host memory
        on_host = all(p.device.type == "cpu" for p in shard_params)
        # The states stay pageable: only the staging buffers are page-locked (staging.py).
        if alias_masters:  # fp32 on a CPU-only machine without DPU: the shard itself is the master
            self.masters = list(shard_params)
        else:
            self.masters = [host_buffer(p, torch.float32, pin=False) for p in shard_params]
            for m, p in zip(self.masters, shard_params):
                self._download(p, m)
        self.exp_avg = [host_buffer(m, torch.float32, pin=False) for m in self.masters]
        self.exp_avg_sq = [host_buffer(m, torch.float32, pin=False) for m in self.masters]
        # Gradients: the device shard is read directly when it already is in host memory and nothing will
        # overwrite it while the step runs (DPU's next backward would).
        self.copy_grads = not on_host or self.delay or staging is not None
        # Allocated once in the one dtype the engine hands over (fp32 when clipping or loss scaling rescales
        # the gradients on the device, else the compute dtype): a 16-bit step after an fp32 one reuses it.
        self.host_grads = [
            host_buffer(m, grad_dtype, pin=False) if self.copy_grads else None for m in self.masters
        ]
        # 16-bit training with host-resident shards and no DPU: the kernel writes the new 16-bit parameters
        # straight into the live shards in the same pass (saves the separate fp32 -> 16-bit copy, ~30-50%).
        self.out16 = None
        if (
            on_host
            and staging is None
            and not self.delay
            and not alias_masters
            and shard_params[0].dtype in (torch.bfloat16, torch.float16)
        ):
            self.out16 = list(shard_params)
        self.step_count = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _download(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.staging is not None:
            self.staging.download(src, dst)
        else:
            dst.copy_(src)

    # ------------------------------------------------------------------------------------------------ step
    def step(
        self,
        grads: list[torch.Tensor],
        lr: float,
        on_unit: Callable[[int], None] | None = None,
        runs: list[list[StepRun]] | None = None,
    ) -> bool:
        """Update the masters from the (clipped, unscaled) gradient shards.

        Returns True when the update runs in the background (DPU past its warm-up of synchronous steps): the
        caller publishes it only after finish(); otherwise `on_unit(i)` runs as soon as shard i is updated.
        """
        self.finish()
        if self.copy_grads:
            for g, host in zip(grads, self.host_grads):
                self._download(g, host)  # complete on return: staging waits on its copies' CUDA events
            grads = self.host_grads
        self.step_count += 1
        runs = runs or all_runs(self.runs, self.step_count)
        if self.delay and self.step_count > self.warmup:
            self._thread = threading.Thread(target=self._run, args=(grads, lr, runs), daemon=True)
            self._thread.start()
            return True
        self._update(grads, lr, runs, on_unit)
        return False

    def finish(self) -> None:
        """Join an in-flight delayed step (before publishing, checkpointing or the next step)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("zoff: the delayed CPU optimizer step failed") from err

    def _run(self, grads: list[torch.Tensor], lr: float, runs: list[list[StepRun]]) -> None:
        try:
            self._update(grads, lr, runs)
        except BaseException as e:  # surfaced by finish() on the main thread
            self._error = e

    def _update(
        self,
        grads: list[torch.Tensor],
        lr: float,
        runs: list[list[StepRun]],
        on_unit: Callable[[int], None] | None = None,
    ) -> None:
        c = self.cfg
        for i, unit_runs in enumerate(runs):
            out = self.out16[i] if self.out16 is not None else None
            for a, b, decay, step in unit_runs:
                if b <= a:
                    continue
                cpu_adam_step(
                    self.masters[i][a:b], grads[i][a:b], self.exp_avg[i][a:b], self.exp_avg_sq[i][a:b],
                    step=step, lr=lr, beta1=c.betas[0], beta2=c.betas[1], eps=c.eps,
                    weight_decay=c.weight_decay if decay else 0.0, adamw_mode=c.name == "adamw",
                    threads=self.threads, out16=None if out is None else out[a:b],
                )  # fmt: skip
            if on_unit is not None:
                on_unit(i)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        self.finish()
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.finish()
        self.step_count = int(state["step"])
        for dst, src in zip(
            self.exp_avg + self.exp_avg_sq, list(state["exp_avg"]) + list(state["exp_avg_sq"])
        ):
            dst.copy_(src)
