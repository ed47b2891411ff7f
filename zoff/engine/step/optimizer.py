"""The optimizer on a rank's partition: Adam(W) over flat fp32 master shards, stepped run by run.

One class for every policy: a storage tier (tiers.py) says where the states live and how gradients and
parameters move; a kernel says how a run is stepped (torch's fused AdamW on the device, zoff's fused CPU Adam
on the host). The engine calls step() and finish(), and reads and writes whole units' states (read/write,
the state-dict and file methods).

Delayed parameter update (DPU, host or disk tier): the CPU step of step i runs in a background thread while
the next forward/backward proceeds with parameters one step stale; `finish()` joins it and the engine
publishes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.optim.adam as torch_adam
import torch.optim.adamw as torch_adamw

from zoff.config import OptimConfig
from zoff.engine.partition import PartitionPlan
from zoff.engine.step.tiers import Tier
from zoff.optim import cpu_adam_step

Run = tuple[int, int, bool]  # (start, end, weight-decayed) within a shard
# (start, end, weight-decayed, Adam step) within a shard: what one step updates, where some parameters got no
# gradient on any rank (they are skipped, like torch's optimizers skip a parameter whose .grad is None, and
# keep their own step count for the bias correction).
StepRun = tuple[int, int, bool, int]


def all_runs(runs: list[list[Run]], step: int) -> list[list[StepRun]]:
    """Every run of every shard at one step count: the usual case, when every parameter has a gradient."""
    return [[(a, b, decay, step) for a, b, decay in unit] for unit in runs]


def step_runs(
    plan: PartitionPlan, rank: int, unused: set[int], skipped: list[int], step: int
) -> list[list[StepRun]]:
    """What this step updates: every parameter with a gradient on some rank, at its own Adam step.

    torch's optimizers skip a parameter whose .grad is None (no gradient anywhere in the step: an expert
    no token picked on any rank): no weight decay, no moment decay, and its step count (bias correction)
    stays behind. zoff does the same, so its numbers equal plain PyTorch's; a zero gradient instead would
    still move the parameter. Cost: runs split at those parameters (one kernel call per run).

    A unit's runs depend on its own parameters only (unit_runs): a unit none of whose parameters is unused
    now or was skipped before steps as `all_runs` has it, whatever the other units' parameters do. So the runs
    a speculation took at begin (no parameter unused) are the step's for exactly the units without an unused
    parameter, a fact every rank holds alike (the step's all-reduce gives `unused`).
    """
    return [unit_runs(plan, u.index, rank, unused, skipped, step) for u in plan.units]


def unit_runs(
    plan: PartitionPlan, unit: int, rank: int, unused: set[int], skipped: list[int], step: int
) -> list[StepRun]:
    """step_runs of one unit: its decay runs (padding included, as `all_runs`) when every parameter of it
    steps at `step`, else run by run over the parameters that step, each at its own Adam step."""
    if not any(si in unused or skipped[si] for si in plan.units[unit].slots):
        return [(a, b, decay, step) for a, b, decay in plan.decay_runs(unit, rank)]
    return slot_runs(plan, unit, rank, unused, skipped, step)


def slot_runs(
    plan: PartitionPlan, unit: int, rank: int, unused: set[int], skipped: list[int], step: int
) -> list[StepRun]:
    """One unit's runs parameter by parameter (padding left out): those with a gradient somewhere, each at
    its own Adam step, neighbours of the same decay and step merged."""
    u = plan.units[unit]
    lo, hi = plan.shard_range(unit, rank)
    runs: list[StepRun] = []
    for si in u.slots:
        s = plan.slots[si]
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a >= b or si in unused:
            continue
        run = (a - lo, b - lo, s.decay, step - skipped[si])
        if runs and runs[-1][1] == run[0] and runs[-1][2:] == run[2:]:
            run = (runs.pop()[0], *run[1:])
        runs.append(run)
    return runs


def torch_fused_kernel(
    p, g, m, v, *, step: int, lr: float, weight_decay: float, cfg: OptimConfig, grad_scale: float = 1.0, **_
) -> None:
    """torch's fused AdamW on one run: it streams memory at close to the machine's limit (CPU or CUDA)."""
    if grad_scale != 1.0:  # (the engine scales first for this kernel: fuses_grad_scale is False)
        g = g.float().mul(grad_scale)
    fn = torch_adamw.adamw if cfg.name == "adamw" else torch_adam.adam
    # the kernel increments it; torch's fused CUDA kernel reads it on the params' device
    steps = [torch.tensor(float(step - 1), device=p.device)]
    fn(
        [p], [g], [m], [v], [], steps, fused=True, amsgrad=False, beta1=cfg.betas[0], beta2=cfg.betas[1],
        lr=lr, weight_decay=weight_decay, eps=cfg.eps, maximize=False,
    )  # fmt: skip


def cpu_fused_kernel(
    p, g, m, v, *, step: int, lr: float, weight_decay: float, cfg: OptimConfig, threads: int, out16=None,
    grad_scale: float = 1.0,
) -> None:  # fmt: skip
    """zoff's fused C++ CPU Adam on one run; reads 16-bit gradients, scaled in registers by `grad_scale`, and
    may write the 16-bit params (out16)."""
    cpu_adam_step(
        p, g, m, v, step=step, lr=lr, beta1=cfg.betas[0], beta2=cfg.betas[1], eps=cfg.eps,
        weight_decay=weight_decay, adamw_mode=cfg.name == "adamw", threads=threads, out16=out16,
        grad_scale=grad_scale,
    )  # fmt: skip


# the kernel multiplies a 16-bit gradient by its scale itself (precision.RescaledGrads' `fused`)
cpu_fused_kernel.fuses_grad_scale = True


class ShardOptimizer:
    """Adam(W) over this rank's master shards, wherever its tier keeps them."""

    def __init__(
        self,
        shards: list[torch.Tensor],
        runs: list[list[Run]],
        cfg: OptimConfig,
        tier: Tier,
        kernel: Callable[..., None],
        *,
        delay_update: bool = False,
        delay_warmup: int = 0,
        threads: int = 1,
        device: torch.device | None = None,
    ):
        self.cfg, self.runs, self.tier, self.kernel, self.threads = cfg, runs, tier, kernel, threads
        self.device = device  # the rank's GPU: a background update's uploads and events run on it
        self.delay, self.warmup = delay_update, delay_warmup
        self.shards = shards
        self.states = tier.make_states(shards)
        resident = self.states.masters  # None: the states live on disk
        self.masters, self.exp_avg, self.exp_avg_sq = resident, self.states.exp_avg, self.states.exp_avg_sq
        # 16-bit training with host-resident shards and no DPU: the CPU kernel writes the new 16-bit parameters
        # straight into the live shards in the same pass (saves the separate fp32 -> 16-bit copy, ~30-50%).
        sixteen = bool(shards) and shards[0].dtype in (torch.bfloat16, torch.float16)
        separate = resident is None or all(m is not s for m, s in zip(resident, shards))
        # (not with shards on disk, parameter offload to nvme: those are written back from the master)
        on_disk = any(s.is_meta for s in shards)
        direct = tier.direct and sixteen and separate and not self.delay and not on_disk
        self.out16 = list(shards) if direct else None
        self.step_count = 0
        self.last_background_s = 0.0  # how long the last background update ran
        self.on_background_end = None  # called from the thread when it ends (even by an error)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.skip: frozenset[int] = frozenset()  # units the next step() leaves alone (committed speculation)

    @property
    def fuses_grad_scale(self) -> bool:
        """True when the kernel takes 16-bit gradients unscaled and a scale (no fp32 copy per unit)."""
        return getattr(self.kernel, "fuses_grad_scale", False)

    @property
    def writes_live_shards(self) -> bool:
        """True when a step leaves the live 16-bit shards updated (nothing left to publish but the gathers)."""
        return self.out16 is not None

    def step(
        self,
        grads: list[torch.Tensor],
        lr: float,
        on_unit: Callable[[int, int | None, torch.Tensor | None], None] | None = None,
        runs: list[list[StepRun]] | None = None,
        background: bool = False,
        delayed_on_unit: Callable[[int, int | None, torch.Tensor | None], None] | None = None,
        skip: frozenset[int] = frozenset(),
    ) -> bool:
        """Update the masters from the (clipped, unscaled) gradient shards.

        `background`: the update runs in a thread with `on_unit` called from it (the engine's overlapped
        step, zero.offload_optimizer.overlap_step); finish() joins it. Returns True then, as for DPU.

        `runs` (default: every run at this step's count) says what to update at which Adam step. Returns True
        when the update runs in the background (DPU past its warm-up of synchronous steps): the caller
        publishes it only after finish(); otherwise `on_unit(i, lo, master)` runs for each updated piece of unit i
        (its master resident, starting at element lo) and `on_unit(i, None, None)` once the unit is done (the
        engine starts its all-gather there). A delayed (DPU) update calls `delayed_on_unit` instead, from its
        thread (the disk tier writes the new parameter shards where the next forward does not read them).
        """
        self.finish()
        self.skip = skip  # `skip`: units committed by the speculation, neither read nor written (no on_unit)
        # per unit, what the kernel multiplies its gradient by (RescaledGrads in fused mode; else 1)
        scale = getattr(grads, "scale", None)
        scales = [scale(i) for i in range(len(grads))] if scale is not None else [1.0] * len(grads)
        grads = self.tier.to_kernel(grads)
        delayed = self.next_step_delayed  # (before the count moves on)
        self.step_count += 1
        runs = runs or all_runs(self.runs, self.step_count)
        if background or delayed:
            on = on_unit if background else delayed_on_unit
            args = (grads, scales, lr, runs, on)
            self._thread = threading.Thread(target=self._run, args=args, daemon=True)
            self._thread.start()
            return True
        self._update(grads, scales, lr, runs, on_unit)
        return False

    @property
    def running(self) -> bool:
        """A background update (DPU's or the overlapped walk) is in flight: the states are its alone."""
        return self._thread is not None

    @property
    def next_step_delayed(self) -> bool:
        """Whether the next step() runs as DPU's background update (past its warm-up of exact steps)."""
        return self.delay and self.step_count + 1 > self.warmup

    @property
    def failed(self) -> bool:
        """Whether the background step has failed (its error waits for finish() to raise it)."""
        return self._error is not None

    def finish(self) -> None:
        """Join an in-flight background step, DPU's or the overlapped walk (before publishing, checkpointing,
        backward or the next step)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(
                "zoff: the background optimizer step (delay_update or overlap_step) failed"
            ) from err

    def _run(self, *update_args) -> None:
        """_update(*update_args) in the background thread, its error kept for finish()."""
        t0 = time.perf_counter()
        # A new thread's current CUDA device is 0: on rank k of a node its uploads' stream context and event
        # waits would make a context on GPU 0 (hundreds of MB) unless the thread works on the rank's device.
        cuda = self.device is not None and self.device.type == "cuda"
        try:
            with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
                self._update(*update_args)
        except BaseException as e:  # surfaced by finish() on the main thread
            self._error = e
        finally:
            self.last_background_s = time.perf_counter() - t0
            if self.on_background_end is not None:
                self.on_background_end()

    def _update(
        self,
        grads: list[torch.Tensor],
        scales: list[float],
        lr: float,
        runs: list[list[StepRun]],
        on_unit: Callable[[int, int | None, torch.Tensor | None], None] | None = None,
    ) -> None:
        for i, unit_runs in enumerate(runs):
            if i in self.skip:
                continue  # committed by the speculation (speculate.py): updated already
            out = self.out16[i] if self.out16 is not None else None
            # pieces: the unit, or its sub-groups on the disk tier, in the walk's order (placement.walk_pieces)
            for k, lo, hi in self.states.spans(i):
                with self.states.open(k) as states:
                    self._piece(states, grads[i], lo, hi, unit_runs, lr, scales[i], out)
                    if on_unit is not None:
                        on_unit(i, lo, states[0])  # this piece's parameters, while its master is resident
            if on_unit is not None:
                on_unit(i, None, None)  # the whole unit is stepped

    def _piece(self, states, grad, lo: int, hi: int, unit_runs, lr: float, scale: float, out) -> None:
        """The kernel over one piece [lo, hi) of a unit: its (master, exp_avg, exp_avg_sq) in `states`."""
        c, (master, m, v) = self.cfg, states
        for a, b, decay, step in unit_runs:
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
            self.kernel(
                master[a - lo : b - lo], grad[a:b], m[a - lo : b - lo], v[a - lo : b - lo],
                step=step, lr=lr, weight_decay=c.weight_decay if decay else 0.0, cfg=c,
                threads=self.threads, out16=None if out is None else out[a:b], grad_scale=scale,
            )  # fmt: skip

    def speculate_unit(
        self, i: int, grad: torch.Tensor, scale: float, lr: float, unit_runs: list[StepRun],
        on_piece: Callable[[int, int, torch.Tensor], None], stop: Callable[[], bool],
    ) -> bool:  # fmt: skip
        """Unit i's update into its pieces' second places (States.speculate), on the speculation's thread during
        backward; `on_piece(i, lo, master)` keeps each piece's new parameters. False when the unit has a piece
        without a second place, or `stop()` said so before its last piece: then nothing of it may commit."""
        spans = self.states.spans(i)
        if not spans or not all(self.states.speculable(k) for k, _, _ in spans):
            return False
        for j, (k, lo, hi) in enumerate(spans):
            if stop():
                return False
            after = spans[j + 1][0] if j + 1 < len(spans) else None
            with self.states.speculate(k, after) as states:
                self._piece(states, grad, lo, hi, unit_runs, lr, scale, None)  # never the live shards
                on_piece(i, lo, states[0])
        return True

    def read(self, i: int, kind: str) -> torch.Tensor:
        """Unit i's master, exp_avg or exp_avg_sq (resident, or a unit-sized copy read from disk)."""
        self.finish()
        return self.states.read(i, kind)

    def write(self, i: int, kind: str, src: torch.Tensor) -> None:
        self.finish()
        self.states.write(i, kind, src)

    def state_dict(self) -> dict:
        """Per kind, a sequence of units read one at a time (a disk tier never holds its whole shard)."""
        self.finish()
        kinds = {k: UnitSequence(self, k, len(self.shards)) for k in ("master", "exp_avg", "exp_avg_sq")}
        return {"step": self.step_count, "exp_avg": kinds["exp_avg"], "exp_avg_sq": kinds["exp_avg_sq"],
                "masters": kinds["master"]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """The step count and the moments; a state without moments leaves them as they are (a checkpoint
        shard copied in with load_file brought them)."""
        self.finish()
        self.step_count = int(state["step"])
        for kind in ("exp_avg", "exp_avg_sq"):
            for i, src in enumerate(state.get(kind, ())):
                self.states.write(i, kind, src)

    def save_file(self, path: Path) -> str | None:
        """The states straight into a checkpoint shard file when they already are one (the disk tier: a copy
        of its swap file); returns its sha256, or None when they must be streamed unit by unit instead."""
        self.finish()
        return self.states.save_file(path)

    def load_file(self, path: Path) -> str | None:
        """Masters and moments straight from a checkpoint shard laid out as the swap file (see save_file);
        returns the copied bytes' sha256, or None (nothing loaded) when the layout differs."""
        self.finish()
        return self.states.load_file(path)

    def resident_bytes(self) -> int:
        return self.states.resident_bytes(self.shards)

    def close(self) -> None:
        self.finish()
        self.states.close()


class UnitSequence:
    """state_dict()'s per-unit states, read when indexed (checkpoint saves walk them unit by unit)."""

    def __init__(self, opt: ShardOptimizer, kind: str, n: int):
        self.opt, self.kind, self.n = opt, kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.opt.read(i, self.kind)
