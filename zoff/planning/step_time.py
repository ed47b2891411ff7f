"""Step time of the offload policies (`zoff estimate --time`): what a step takes on this box, from three rates
measured here and the estimate's own byte counts, so the time sits beside the memory it buys.

The rates (Rates):
- compute: one micro-batch's forward and backward of the configured model on one rank, timed on this box at
  two depths (model.n_layer 1 and 2, every weight in RAM, the compute dtype, the rank's share of the cores)
  and scaled per layer to the configured depth; builtin GPT only (`--compute-s` gives it for any model);
- the fused CPU Adam, per parameter of the rank's shard (16M parameters through zoff's kernel);
- the disk: the last `zoff bench-io` of the swap path (or an assumed 1 GB/s, said so).

The model of a step is the engine's schedule, not an ideal: forward and backward overlap the parameter reads
and gradient writes of the disk tier (the step takes the longer of the two); then the optimizer phase
overlaps the CPU Adam with the streamed states' and gradients' reads and the write-backs, which the disk
serves one after the other (the longer of Adam and the disk). Tested against the measured 3.4B demo in
bench_beyond_memory.py (docs/benchmarks.md); a GPU host's compute is its own probe on the GPU.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass

import torch

from zoff.config import DataConfig, ModelConfig, TrainConfig, ZeroConfig
from zoff.engine.disk.placement import piece_bytes, subgroup_of
from zoff.engine.policy import Policy
from zoff.engine.precision import DTYPES
from zoff.host.kernels import compute_precision, slow_dtype, upcasts
from zoff.planning.memory import Estimate, PolicyEstimate
from zoff.planning.speculated_time import Speculated, speculated_work


@dataclass(frozen=True)
class Rates:
    compute_s: float  # one micro-batch's forward + backward of the whole model on one rank
    adam_s_per_param: float  # the fused CPU Adam on one rank's threads
    read_gbps: float
    write_gbps: float
    sources: tuple[str, ...]


@dataclass(frozen=True)
class StepTime:
    forward_backward_s: float  # micro-batches x compute, or the disk of that phase when it is longer
    optimizer_s: float  # the CPU Adam, or the disk of the step when it is longer
    bound: str  # what sets each phase: "compute|disk" + " / " + "adam|disk"
    # a row that speculates (speculated_time.py): its step when the clip does not trigger, every speculated
    # unit committed; this one is then its step when the clip triggers (nothing committed). None: it does not
    speculated: StepTime | None = None

    @property
    def step_s(self) -> float:
        return self.forward_backward_s + self.optimizer_s


def predict(
    pe: PolicyEstimate, plan_pieces: tuple[int, ...], rates: Rates, micro_batches: int, shard: int,
    overlap: bool = False, shared_cores: bool = True, delayed: bool = False,
) -> StepTime:  # fmt: skip
    """One offload policy's step on one rank. `plan_pieces`: the optimizer's piece bytes (piece_bytes), those
    in `pe.split.resident` stay in RAM; `shard`: the rank's trainable parameters. `overlap`: the overlapped
    step (overlap_step, stage 3 with the optimizer offloaded), whose walk runs beside the next forward (a third of the compute): backward,
    then the longer of the walk's disk and the cores' work beside it, the forward and the CPU Adam one after
    the other on a CPU-only host (`shared_cores`), the longer of the two where the Adam has cores of its own
    (a GPU host). Measured on the 3.4B demo (scripts/bench_overlap.py, af92201): 30.2 s a step, the walk
    14.2-14.3 s of it beside the forward, against 37.0-37.8 s serial. `delayed` (delay_update, past its
    warm-up): the update runs beside the next forward and backward, so the step is the longer of the cores'
    work (compute and Adam, one after the other on shared cores) and all of the step's disk I/O; where the
    parameters live in memory the read-back of the new shards' file (`pe.disk_publish`) follows it.
    A row that speculates (speculated_time.speculated_work) gets its unclipped step as `.speculated`."""
    if delayed:
        rbw, wbw = rates.read_gbps * 1e9, rates.write_gbps * 1e9
        compute, adam = micro_batches * rates.compute_s, shard * rates.adam_s_per_param
        cpu = compute + adam if shared_cores else max(compute, adam)
        reread = pe.disk_publish / rbw  # (parameters in memory: their new shards' file, read back after it)
        disk = pe.disk_read / rbw + pe.disk_written / wbw - reread
        which = "cores" if cpu >= disk else "disk"
        return StepTime(max(cpu, disk), reread, f"delayed update beside forward and backward: {which}")
    phases = _phase_bytes(pe, plan_pieces, micro_batches)
    overlap = overlap and pe.policy.stage == 3  # (stage 1-2 have no gathers for the walk to hide under)
    plain = _schedule(phases, rates, micro_batches, shard, overlap, shared_cores)
    spec = speculated_work(pe, shard)  # (delay_update never speculates: speculation.speculates)
    if spec is None:
        return plain
    return dataclasses.replace(
        plain, speculated=_schedule(phases, rates, micro_batches, shard, overlap, shared_cores, spec)
    )


def _phase_bytes(
    pe: PolicyEstimate, plan_pieces: tuple[int, ...], micro_batches: int
) -> tuple[int, int, int, int]:
    """(forward and backward's disk bytes read, written; the step's read, written) of one rank's step."""
    resident = set(pe.split.resident)
    streamed = sum(n for k, n in enumerate(plan_pieces) if k not in resident)
    streamed = streamed if pe.policy.offload_optimizer == "nvme" else 0
    grads = pe.disk_grads // pe.grad_files if pe.split.grads_on_disk else 0  # (one file a step)
    # the step phase reads the streamed states and the gradient file and writes the states back; the rest
    # of the disk's bytes (parameter reads, gradient landings) belong to forward and backward
    step_read, step_written = streamed + grads, streamed
    if pe.policy.offload_param == "nvme":  # the step writes each trainable shard back
        step_written += max(0, pe.disk_written - streamed - micro_batches * grads)
    fb_read = max(0, pe.disk_read - step_read)
    fb_written = max(0, pe.disk_written - step_written)
    return fb_read, fb_written, step_read, step_written


def _schedule(
    phases: tuple[int, int, int, int], rates: Rates, micro_batches: int, shard: int, overlap: bool,
    shared_cores: bool, spec: Speculated | None = None,
) -> StepTime:  # fmt: skip
    """The exact step's two phases (predict's docstring) from `_phase_bytes`; with `spec`, a committed
    speculation: its units' bytes and CPU Adam leave the walk for the last micro-batch's backward."""
    rbw, wbw = rates.read_gbps * 1e9, rates.write_gbps * 1e9
    fb_read, fb_written, step_read, step_written = phases
    # overlap: a third of one micro-batch's forward + backward meets the walk, beside the next step's forward
    forward = rates.compute_s / 3 if overlap else 0.0
    cores = micro_batches * rates.compute_s - forward
    fb_disk = fb_read / rbw + fb_written / wbw  # (the forward's own reads: within the walk's disk time)
    adam = shard * rates.adam_s_per_param
    opt_disk = step_read / rbw + step_written / wbw
    if spec is not None:
        moved = spec.read / rbw + spec.written / wbw
        spec_adam = spec.params * rates.adam_s_per_param
        last = 2 * rates.compute_s / 3  # the last backward: the gradients become final (and the worker runs)
        # the disk serves backward's own bytes and the worker's one after the other, the worker's from the
        # last backward on; its Adam takes backward's own cores on a CPU-only host, on a GPU host the host's
        # (idle then), where only what outlasts the last backward lengthens the phase
        fb_disk = max(fb_disk, cores - last) + moved
        cores += spec_adam if shared_cores else max(0.0, spec_adam - last)
        adam, opt_disk = adam - spec_adam, opt_disk - moved
    backward = max(cores, fb_disk)
    if overlap:  # (with the states in RAM the walk is the CPU Adam alone)
        cpu = forward + adam if shared_cores else max(forward, adam)
        which = "cores" if cpu >= opt_disk else "disk"
        return StepTime(backward, max(cpu, opt_disk), f"backward, then forward with the step: {which}")
    return StepTime(
        backward, max(adam, opt_disk),
        f"{'compute' if cores >= fb_disk else 'disk'} / {'adam' if adam >= opt_disk else 'disk'}",
    )  # fmt: skip


def predict_all(
    est: Estimate, rates: Rates, plan_pieces: dict[int, tuple[int, ...]], shard: dict[int, int], micro: int,
    overlap: bool = False, shared_cores: bool = True, delayed: bool = False,
):  # fmt: skip
    """{policy: StepTime} for every offload policy of the estimate (plan_pieces and shard by stage)."""
    return {
        pe.policy: predict(
            pe,
            plan_pieces[pe.policy.stage],
            rates,
            micro,
            shard[pe.policy.stage],
            overlap,
            shared_cores,
            delayed,
        )  # fmt: skip
        for pe in est.policies
        if pe.policy.offload_optimizer != "none"
    }


# ------------------------------------------------------------------------------------------------ probes


def probe_engine(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    train_cfg: TrainConfig,
    zero: ZeroConfig,
    local_ranks: int,
    steps: int = 2,
) -> tuple[float, float]:
    """(forward + backward seconds per micro-batch, CPU Adam seconds per parameter) of zoff's own engine on
    this box: the configured builtin GPT at depths 1 and 2, stage 3 with every state in host memory
    (zero3-offload: the gathers, hooks, reductions and fused CPU Adam of the disk tier's run, without its
    disk), the rank's share of the cores, one warm-up step then the median of `steps`; scaled per layer.
    A bare forward/backward of the model misses the engine's own work: 35% short at the 3.4B demo's shape."""
    from zoff.config import OffloadOptimizerConfig, OffloadParamConfig, OptimConfig
    from zoff.engine import build_engine
    from zoff.models import enable_activation_checkpointing, meta_model
    from zoff.models.upcast import upcast_compute

    if model_cfg.name != "gpt":
        raise ValueError("the compute probe builds the builtin GPT only; give --compute-s for other models")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_ranks)))
    in_ram = dataclasses.replace(
        zero, stage=3, offload_optimizer=OffloadOptimizerConfig(device="cpu"),
        offload_param=OffloadParamConfig(device="cpu"),
    )  # fmt: skip
    fb, adam = [], []
    try:
        for depth in (1, 2):
            model = meta_model(dataclasses.replace(model_cfg, n_layer=depth))
            if upcasts(train_cfg.precision, train_cfg.cpu_precision, on_cpu=True):
                upcast_compute(model)
            if train_cfg.activation_checkpointing:
                enable_activation_checkpointing(model)
            eng = build_engine(model, in_ram, OptimConfig(), precision=train_cfg.precision,
                               grad_clip=train_cfg.grad_clip)  # fmt: skip
            x = torch.randint(0, model_cfg.vocab_size, (data_cfg.batch_size, data_cfg.seq_len))
            runs = []
            for _ in range(steps + 1):
                eng.zero_grad()
                t0 = time.perf_counter()
                eng.backward(eng.model(x).float().logsumexp(-1).mean())
                t1 = time.perf_counter()
                eng.step(1e-5)
                runs.append((t1 - t0, time.perf_counter() - t1))
            fb.append(statistics.median(r[0] for r in runs[1:]))
            adam.append(statistics.median(r[1] for r in runs[1:]) / eng.plan.numel)
            eng.close()
    finally:
        torch.set_num_threads(threads)
    per_layer = max(0.0, fb[1] - fb[0])
    return fb[0] - per_layer + model_cfg.n_layer * per_layer, adam[1]


def probe_adam(precision: str, local_ranks: int, numel: int = 16 << 20, reps: int = 3) -> float:
    """Seconds per parameter of zoff's fused CPU Adam on one rank's share of the cores (16-bit gradients and
    the 16-bit copy written in the same pass, as the host tier steps)."""
    from zoff.optim import cpu_adam_step

    threads = max(1, (os.cpu_count() or 1) // max(1, local_ranks))
    half = DTYPES[precision] if precision != "fp32" else None
    p, m, v = (torch.rand(numel) for _ in range(3))
    g = torch.rand(numel, dtype=half or torch.float32)
    out16 = torch.empty(numel, dtype=half) if half is not None else None
    runs = []
    for step in range(1, reps + 2):
        t0 = time.perf_counter()
        cpu_adam_step(p, g, m, v, step=step, lr=1e-4, weight_decay=0.1, out16=out16, threads=threads)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[1:]) / numel


def _probe_compute(
    model_cfg: ModelConfig, data_cfg: DataConfig, train_cfg: TrainConfig, zero: ZeroConfig, local_ranks: int
) -> tuple[float, float, str]:
    """probe_engine in the precision a rank computes in on this CPU (train.cpu_precision), and its source line.
    A 16-bit dtype without a fast kernel here is probed in fp32 and scaled by its matmul factor
    (zoff.host.kernels): its own probe would take minutes a layer at the demo's width (~100x fp32), and the
    step is matmul-bound; the line says so."""
    precision, _ = compute_precision(train_cfg.precision, train_cfg.cpu_precision, on_cpu=True)
    slow = slow_dtype(precision)
    upcast = upcasts(train_cfg.precision, train_cfg.cpu_precision, on_cpu=True)  # probed as it runs
    probed = train_cfg if upcast else dataclasses.replace(train_cfg, precision="fp32" if slow else precision)
    compute_s, adam = probe_engine(model_cfg, data_cfg, probed, zero, local_ranks)
    src = f"compute: zoff's engine probed here (n_layer 1 and 2 in RAM, scaled per layer) in {precision}"
    if precision != train_cfg.precision:
        over = f" over {train_cfg.precision} states" if upcast else ""
        src += f" (train.cpu_precision={train_cfg.cpu_precision}: {train_cfg.precision} runs in fp32{over} on this CPU)"
    if slow:
        compute_s *= slow.factor
        src = src.replace(f"in {precision}", f"in fp32 x {slow.factor:.0f} ({slow.describe()})")
    return compute_s, adam, src


def measure_rates(
    model_cfg: ModelConfig, data_cfg: DataConfig, train_cfg: TrainConfig, zero: ZeroConfig, local_ranks: int,
    compute_s: float | None = None,
) -> Rates:  # fmt: skip
    """The three rates for this box: compute (probed, or `compute_s`), CPU Adam (probed), disk (bench-io)."""
    from zoff.planning.bench_io import disk_bandwidth

    read, write, disk_src = disk_bandwidth(zero.offload_optimizer.nvme_path)
    if compute_s is None:
        compute_s, adam, c_src = _probe_compute(model_cfg, data_cfg, train_cfg, zero, local_ranks)
    else:
        adam = probe_adam(train_cfg.precision, local_ranks)
        c_src = "compute: --compute-s"
    sources = (c_src, f"CPU Adam: probed here ({1e9 * adam:.2f} ns/param)", f"disk: {disk_src}")
    return Rates(compute_s, adam, read, write, sources)


def plan_inputs(model_cfg: ModelConfig, zero: ZeroConfig, world: int) -> tuple[dict, dict]:
    """Per stage (1 and 3: stage 2 shares 1's plan): the optimizer's piece bytes and the rank's shard."""
    from zoff.engine.policy import engine_plan
    from zoff.models import meta_model

    model = meta_model(model_cfg)
    pieces, shard = {}, {}
    for stage in (1, 2, 3):
        plan = engine_plan(model, stage, world, zero)
        pieces[stage] = piece_bytes(plan, subgroup_of(zero))
        shard[stage] = sum(u.shard for u in plan.units)
    return pieces, shard


def policy_label(p: Policy) -> str:
    return p.name + (" + act. ckpt" if p.activation_checkpointing else "")
