"""The floor an offload step is judged against, measured in the same job as the step (issue 32).

The floor is what this machine cannot do faster: on a CPU-only host compute and the CPU Adam share the cores,
so floor = max(compute + Adam, disk bytes per step / raw bandwidth); on a GPU host the three overlap, so floor
= max(compute, Adam, disk). The compute and Adam part is measured, never assumed: the same config with fewer
layers and every state in RAM (zero3-offload: the same shards, gathers, reductions and fused CPU Adam, with
no disk), trained a few steps at two depths, gives a fixed and a per-layer time; scaled to the config's
depth it is what the full model would take with all of its states in RAM. The disk part is the bytes the
run moved per step over the raw O_DIRECT bandwidth `zoff bench-io` measured on the same path in the same job.
On a CPU without fast kernels for the config's 16-bit precision the floor computes in fp32, as the run does
(benchlib.cpu_precision_plan: train.cpu_precision=fp32), unless `native`.

Used by bench_beyond_memory.py; importable on its own:

    from offload_floor import measure_compute
    measure_compute(Path("configs/gpt-3b-nvme.yaml"), overrides, depths=(2, 4), steps=4)
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchlib import cpu_precision_plan, train_records

from zoff.config import load_config

# every state in RAM: the same stage and gathers as the disk tier's run, its bytes never touch the disk
IN_RAM = [
    "zero.offload_optimizer.device=cpu",
    "zero.offload_param.device=cpu",
    "zero.offload_optimizer.overlap_step=false",  # (the disk tier's: no walk to overlap with states in RAM)
    "checkpoint.enabled=false",
    "train.log_every=1",
    "train.eval_batches=1",
]


def measure_compute(
    config: Path, overrides: list[str], depths: tuple[int, int], steps: int, layers: int, rounds: int = 2,
    samples: dict[int, list[float]] | None = None, first_round: int = 0, native: bool = False,
) -> dict:  # fmt: skip
    """Train `config` (with `overrides`, the disk tier's own) at two depths with every state in RAM and
    return the per-layer fit scaled to `layers`: {depth: step seconds, ..., per_layer_s, fixed_s, scaled_s}.

    The depths alternate over `rounds` (A B, B A, ...) and each depth's time is the median of all its steady
    steps: the per-layer slope is a difference of two times, multiplied by the model's depth, so a host whose
    speed moves between two single runs moved the floor by a quarter (2026-11-27: 21.8, 28.7 and 24.7 s).
    `samples` (depth -> step times) carries rounds measured earlier, which the fit includes (a benchmark
    that brackets its run: rounds before it and after it); `first_round` continues their alternation.
    Where the config computes in a 16-bit dtype this CPU has no fast kernel for, the floor computes in fp32
    (out["cpu_precision"]), unless `native`."""
    keep = [o for o in overrides if not o.startswith(("model.n_layer=", "train.max_steps=", "zero.offload_"))]
    train = load_config(config, [*keep, *IN_RAM]).train
    cpu = cpu_precision_plan("offload_floor", train.precision, native, cpu_precision=train.cpu_precision)
    keep += cpu.overrides
    samples = samples if samples is not None else {d: [] for d in depths}
    for r in range(first_round, first_round + rounds):
        for depth in depths if r % 2 == 0 else depths[::-1]:
            run = [*keep, *IN_RAM, f"model.n_layer={depth}", f"train.max_steps={steps}"]
            records = train_records(config, run, "offload_floor")
            if not records:
                raise RuntimeError(f"offload_floor: no step times from {config} at {depth} layers")
            for key in PHASES:  # the step, and its forward and backward (the trainer's record has each)
                times = [x[key] for x in records if key in x]
                samples.setdefault(depth if key == "step_time_s" else f"{key}:{depth}", []).extend(
                    times[1:] or times  # (the first step warms up)
                )
    out = {"depths": list(depths), "steps": steps, "rounds": first_round + rounds,
           "policy": "zero3-offload (every state in RAM)", "cpu_precision": cpu.to_json()}  # fmt: skip
    (d0, d1), (t0, t1) = depths, [statistics.median(samples[d]) for d in depths]
    per_layer, fixed = _fit(depths, (t0, t1))
    out |= {"step_s": {str(d0): t0, str(d1): t1}, "samples_s": {str(d): samples[d] for d in depths},
            "per_layer_s": per_layer, "fixed_s": fixed, "layers": layers,
            "scaled_s": fixed + layers * per_layer}  # fmt: skip
    phases = {}
    for key in PHASES[1:]:
        got = [samples.get(f"{key}:{d}") for d in depths]
        if all(got):
            slope, base = _fit(depths, [statistics.median(x) for x in got])
            phases[key] = base + layers * slope
    if len(phases) == 2:  # the rest of a step: the optimizer's (the CPU Adam) and the trainer's own
        phases["optimizer_s"] = max(0.0, out["scaled_s"] - phases["forward_s"] - phases["backward_s"])
        out["scaled_phases_s"] = phases
    return out


PHASES = ("step_time_s", "forward_s", "backward_s")


def _fit(depths: tuple[int, int], times: tuple[float, float] | list[float]) -> tuple[float, float]:
    """(per-layer seconds, fixed seconds) through two depths' times."""
    (d0, d1), (t0, t1) = depths, times
    per_layer = (t1 - t0) / (d1 - d0)
    return per_layer, t0 - d0 * per_layer


def floor(
    compute_s: float, read_bytes: float, written_bytes: float, read_gbps: float, write_gbps: float
) -> dict:
    """max(compute + Adam, disk bytes at raw bandwidth), reads and writes one after the other (the disk serves
    one stream of requests); each term kept, so a reader sees which bounds the step."""
    disk_s = read_bytes / (read_gbps * 1e9) + written_bytes / (write_gbps * 1e9)
    return {"compute_adam_s": compute_s, "disk_s": disk_s, "floor_s": max(compute_s, disk_s),
            "bound": "compute + CPU Adam" if compute_s >= disk_s else "disk"}  # fmt: skip


def overlapped_bound(phases: dict, walk_read: float, walk_written: float, read_gbps: float, write_gbps: float,
                     shared_cores: bool = True) -> dict:  # fmt: skip
    """What the overlapped step (zero.offload_optimizer.overlap_step) can do at best: backward at its speed
    with every state in RAM, then the next forward beside the optimizer's walk, whose bytes (`walk_read`,
    `walk_written`: the states streamed, the gradient shard read, the parameter shards written back) move at
    raw bandwidth. Why a bound of any exact step under a RAM budget: clipping's coefficient needs every
    gradient, so no update starts before backward ends, and the next forward needs each block updated before
    it computes it; what the walk reads and writes therefore moves between the two, unless RAM holds it
    (the budget spent on resident states saves those bytes already). On a CPU-only host the forward and the
    CPU Adam share the cores (`shared_cores`)."""
    fwd, bwd, adam = phases["forward_s"], phases["backward_s"], phases["optimizer_s"]
    walk_disk = walk_read / (read_gbps * 1e9) + walk_written / (write_gbps * 1e9)
    cores = fwd + adam if shared_cores else max(fwd, adam)
    return {"backward_s": bwd, "forward_adam_s": cores, "walk_disk_s": walk_disk,
            "bound_s": bwd + max(cores, walk_disk)}  # fmt: skip
