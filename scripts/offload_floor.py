"""The floor an offload step is judged against, measured in the same job as the step (issue 32).

The floor is what this machine cannot do faster: on a CPU-only host compute and the CPU Adam share the cores,
so floor = max(compute + Adam, disk bytes per step / raw bandwidth); on a GPU host the three overlap, so floor
= max(compute, Adam, disk). The compute and Adam part is measured, never assumed: the same config with fewer
layers and every state in RAM (zero3-offload: the same shards, gathers, reductions and fused CPU Adam, with
no disk), trained a few steps at two depths, gives a fixed and a per-layer time; scaled to the config's
depth it is what the full model would take with all of its states in RAM. The disk part is the bytes the
run moved per step over the raw O_DIRECT bandwidth `zoff bench-io` measured on the same path in the same job.

Used by bench_beyond_memory.py; importable on its own:

    from offload_floor import measure_compute
    measure_compute(Path("configs/gpt-3b-nvme.yaml"), overrides, depths=(2, 4), steps=4)
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchlib import train_records

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
    samples: dict[int, list[float]] | None = None, first_round: int = 0,
) -> dict:  # fmt: skip
    """Train `config` (with `overrides`, the disk tier's own) at two depths with every state in RAM and
    return the per-layer fit scaled to `layers`: {depth: step seconds, ..., per_layer_s, fixed_s, scaled_s}.

    The depths alternate over `rounds` (A B, B A, ...) and each depth's time is the median of all its steady
    steps: the per-layer slope is a difference of two times, multiplied by the model's depth, so a host whose
    speed moves between two single runs moved the floor by a quarter (2026-11-27: 21.8, 28.7 and 24.7 s).
    `samples` (depth -> step times) carries rounds measured earlier, which the fit includes (a benchmark
    that brackets its run: rounds before it and after it); `first_round` continues their alternation."""
    keep = [o for o in overrides if not o.startswith(("model.n_layer=", "train.max_steps=", "zero.offload_"))]
    samples = samples if samples is not None else {d: [] for d in depths}
    for r in range(first_round, first_round + rounds):
        for depth in depths if r % 2 == 0 else depths[::-1]:
            run = [*keep, *IN_RAM, f"model.n_layer={depth}", f"train.max_steps={steps}"]
            times = [r["step_time_s"] for r in train_records(config, run, "offload_floor")]
            if not times:
                raise RuntimeError(f"offload_floor: no step times from {config} at {depth} layers")
            samples.setdefault(depth, []).extend(times[1:] or times)  # (the first step warms up)
    (d0, d1), (t0, t1) = depths, [statistics.median(samples[d]) for d in depths]
    per_layer = (t1 - t0) / (d1 - d0)
    fixed = t0 - d0 * per_layer
    return {"depths": list(depths), "steps": steps, "rounds": first_round + rounds,
            "policy": "zero3-offload (every state in RAM)",
            "step_s": {str(d0): t0, str(d1): t1}, "samples_s": {str(d): samples[d] for d in depths},
            "per_layer_s": per_layer, "fixed_s": fixed, "layers": layers,
            "scaled_s": fixed + layers * per_layer}  # fmt: skip


def floor(
    compute_s: float, read_bytes: float, written_bytes: float, read_gbps: float, write_gbps: float
) -> dict:
    """max(compute + Adam, disk bytes at raw bandwidth), reads and writes one after the other (the disk serves
    one stream of requests); each term kept, so a reader sees which bounds the step."""
    disk_s = read_bytes / (read_gbps * 1e9) + written_bytes / (write_gbps * 1e9)
    return {"compute_adam_s": compute_s, "disk_s": disk_s, "floor_s": max(compute_s, disk_s),
            "bound": "compute + CPU Adam" if compute_s >= disk_s else "disk"}  # fmt: skip
