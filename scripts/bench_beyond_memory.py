#!/usr/bin/env python
"""Train a model whose states do not fit in RAM, and measure what the job really used (issue 18's demonstration).

Not a test. In one run: check the disk has room for the run's swap files (exit 0 with a message when it has
not), take `zoff estimate`'s figures for the configured policy (in-process, the same functions), measure the
swap path with `zoff bench-io`'s own I/O at the config's io setting, then run `zoff train` on the config as a
subprocess and sample every --interval seconds, from /proc: the RSS of the launcher and of every descendant
(the ranks, labelled by the rank log each holds open), their sum, the page cache (Cached) against its level
before the run, the swap files' size, and the disk bytes the ranks read and wrote (/proc/<pid>/io, and the
device's /proc/diskstats, which counts every process on the machine). Afterwards it reads the run's
metrics.jsonl and rank logs and prints one table (parameters, model-state bytes against RAM, peak RSS, page
cache, disk traffic per step and GB/s against bench-io, step time split, loss per step, estimate vs measured)
and writes it all to JSON.

    python scripts/bench_beyond_memory.py                       # configs/gpt-3b-nvme.yaml: 3.4B params, ~50 GB disk
    python scripts/bench_beyond_memory.py --size 1b --steps 3 --path /var/tmp/zoff-swap
    python scripts/bench_beyond_memory.py --size tiny --steps 3 --io-size 64MiB
    python scripts/bench_beyond_memory.py --config my-hf.yaml --size tiny [KEY.PATH=VALUE ...]
    python scripts/bench_beyond_memory.py --render   # the markdown table from the JSON (what the docs embed)
    python scripts/bench_beyond_memory.py --preset 2g --steps 6      # a preset: its overrides, its own JSON

--preset picks one of PRESETS below: its overrides go after the command line's, and it writes its own JSON
(docs/results/bench_beyond_memory{,_2g,_dpu,_dpu_2g,_unclipped,_unclipped_2g}.json), which the docs render in the region
`<!-- render: bench_beyond_memory --preset NAME -->` (the default's: `render: bench_beyond_memory`):
  default   the config as it is
  2g        the rank's host budget forced to 2 GiB: on this CPU host the model's working memory (gathered
            blocks, activations) takes most of it, so every optimizer state of the 3.4B demo streams from disk
            (issue 32's "budget forced small" figures)
  dpu       the opt-in delayed update (zero.offload_optimizer.delay_update, ZeRO-Offload's DPU on the disk
            tier: parameters one step stale, so NOT the exact numbers of the other tables): each step's
            optimizer walk runs beside the next step's forward and backward (issue 32's "a mode that changes
            the math", off in every shipped recipe)
  dpu-2g    dpu with the host budget forced to 2 GiB
  unclipped the clip above every norm of the run (train.grad_clip=1e9), as in a warmed-up run that does not
            clip: speculate auto (the config's) computes each unit's update beside backward and commits it
            (issue 53's regime a; the demo as configured clips every step from initialisation: regime b)
  unclipped-2g  unclipped with the host budget forced to 2 GiB: the speculated updates' second slots go to
            disk beside every state, as far as the disk room left by the swap files allows (the plan says how
            many units fit)

--size sets model.n_layer / n_head / d_model (an hf: model maps them onto its config); without it the config's
own model is used. Trailing KEY.PATH=VALUE overrides go to `zoff estimate` and `zoff train` alike.

On a CPU without fast kernels for the config's 16-bit precision (no AVX512: bf16 ~100x fp32's time) the run and
its floor compute in fp32 (train.cpu_precision=fp32, added after the command line's overrides; the JSON's
"cpu_precision" and the table say so); --native-precision keeps the 16-bit compute, and its hours.

The JSON goes to the preset's file under docs/results/ (--json), the RSS time series beside it
(its .series.json): the table needs only the peaks, which the JSON holds.

The swap folders, the estimate, the disk's room and its bandwidth before the run are beyond_memory_plan.py's;
the /proc readings and the sampler are beyond_memory_probe.py's; the measured fields, set against the
estimate, and the table are beyond_memory_report.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from beyond_memory_plan import (
    configured_estimate,
    disk_bandwidth,
    nvme_sections,
    saves_final_checkpoint,
    short_of_room,
)
from beyond_memory_probe import Sampler, block_device, import_baseline_rss, meminfo
from beyond_memory_report import measure, render, title
from offload_floor import floor, measure_compute, overlapped_bound
from rich.console import Console

from zoff.config import CONFIGS_DIR, Config, load_config
from zoff.engine.footprint import data_parallel_bytes
from zoff.planning.memory import Estimate

# model.* of each --size (64-wide heads); parameters of the builtin GPT at vocab 256, seq_len 128
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "d_model": 256},  # 1.7M
    "100m": {"n_layer": 12, "n_head": 12, "d_model": 768},  # 85M
    "1b": {"n_layer": 20, "n_head": 16, "d_model": 2048},  # 1.0B
    "3b": {"n_layer": 30, "n_head": 24, "d_model": 3072},  # 3.4B
}
DEFAULT_CONFIG = CONFIGS_DIR / "gpt-3b-nvme.yaml"
BUDGET_2G = "zero.offload_optimizer.host_budget=2GiB"
DPU = ("zero.offload_optimizer.overlap_step=false", "zero.offload_optimizer.delay_update=true")
# the clip far above the demo's norms (155-456 from initialisation), as in a warmed-up run whose norms stay under
# its clip: exact speculation commits every update it computed beside backward (issue 53's regime a)
UNCLIPPED = "train.grad_clip=1e9"
PRESETS = {  # (the docstring says what each is for)
    "default": benchlib.Preset(benchlib.RESULTS / "bench_beyond_memory.json"),
    "2g": benchlib.Preset(benchlib.RESULTS / "bench_beyond_memory_2g.json", (BUDGET_2G,)),
    "dpu": benchlib.Preset(benchlib.RESULTS / "bench_beyond_memory_dpu.json", DPU),
    "dpu-2g": benchlib.Preset(benchlib.RESULTS / "bench_beyond_memory_dpu_2g.json", (*DPU, BUDGET_2G)),
    "unclipped": benchlib.Preset(benchlib.RESULTS / "bench_beyond_memory_unclipped.json", (UNCLIPPED,)),
    "unclipped-2g": benchlib.Preset(
        benchlib.RESULTS / "bench_beyond_memory_unclipped_2g.json", (UNCLIPPED, BUDGET_2G)
    ),
}
JSON = PRESETS["default"].json


# ----------------------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.preset_args(ap, PRESETS)  # first: the recorded command reads `--preset 2g --steps 6`
    ap.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="any zoff config (builtin GPT or hf:)"
    )
    ap.add_argument("--size", choices=sorted(SIZES), help="model.n_layer/n_head/d_model of a named size")
    ap.add_argument("--steps", type=int, help="train.max_steps (default: the config's)")
    ap.add_argument(
        "--path", type=Path, help="the swap folder (default: the config's nvme_path); made if missing"
    )
    ap.add_argument("--nproc", type=int, help="ranks (launch.nproc_per_node)")
    ap.add_argument(
        "--run-dir", type=Path, help="zoff train's run directory (default runs/bench/beyond-memory-<time>)"
    )
    ap.add_argument("--io-size", default="1GiB", help="bytes of the bench-io measurement (0: skip it)")
    ap.add_argument("--margin", default="2GiB", help="free disk kept beyond the swap files (and checkpoint)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between /proc samples")
    ap.add_argument(
        "--floor-depths", default="2,6",
        help="the floor's two depths (model.n_layer) trained with every state in RAM; '' skips the floor",
    )  # fmt: skip
    ap.add_argument(
        "--floor-steps", type=int, default=5, help="steps of each floor run (the first is dropped)"
    )
    ap.add_argument("--floor-rounds", type=int, default=2, help="rounds of the floor's depths, alternating")
    benchlib.native_precision_arg(ap)
    ap.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE overrides for estimate and train")
    return ap


def build_overrides(a: argparse.Namespace, switch: tuple[str, ...] = ()) -> list[str]:
    """The line's overrides, then `switch` (CpuPrecision.overrides), the preset's and --path's."""
    out = [f"model.{k}={v}" for k, v in SIZES.get(a.size or "", {}).items()]
    if a.steps is not None:
        out.append(f"train.max_steps={a.steps}")
    if a.nproc is not None:
        out.append(f"launch.nproc_per_node={a.nproc}")
    out.append("train.log_every=1")  # a record per step: its loss and its time
    out += [*a.overrides, *switch, *PRESETS[a.preset].overrides]  # the preset's last: win over the line's
    if a.path is not None:  # both sections (offload_param falls back to the optimizer's path anyway)
        out += [f"zero.{sec}.nvme_path={a.path}" for sec in ("offload_optimizer", "offload_param")]
    return out


def planned_config(a: argparse.Namespace, con: Console) -> tuple[list[str], Config, benchlib.CpuPrecision]:
    """The overrides, the config they make and what its ranks compute in: where the config's 16-bit dtype has
    no fast kernel on this CPU, train.cpu_precision=fp32 joins the overrides (the run's, the estimate's and
    the floor's alike), unless --native-precision."""
    overrides = build_overrides(a)
    cfg = load_config(a.config, overrides)
    cpu = benchlib.cpu_precision_plan(
        "bench_beyond_memory", cfg.train.precision, a.native_precision, cpu_precision=cfg.train.cpu_precision
    )
    if cpu.overrides:
        overrides = build_overrides(a, cpu.overrides)
        cfg = load_config(a.config, overrides)
        con.print(f"{cpu.matmul}: computing in fp32 ({' '.join(cpu.overrides)}; {benchlib.NATIVE_FLAG} keeps "
                  f"{cpu.configured})")  # fmt: skip
    return overrides, cfg, cpu


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    benchlib.resolve_output(a, PRESETS)
    if a.render:
        return benchlib.print_rendered(a.out, render)
    con = Console(width=max(Console().width, 150))
    overrides, cfg, cpu = planned_config(a, con)
    sections = nvme_sections(cfg)
    if not sections:
        con.print(
            "[yellow]warning: this config keeps nothing on disk (no zero.*.device nvme): no disk tier to measure"
        )
    swap_dirs = sorted(set(sections.values()))
    swap_root = swap_dirs[0] if swap_dirs else None
    result, est, row = planned_result(ap, a, overrides, cfg, cpu, sections, swap_dirs)

    # ---- room on the disk first
    if swap_root is not None:
        refusal = short_of_room(swap_dirs, row, a.margin, result)
        if refusal is not None:
            con.print(refusal)
            result["status"] = "no room"
            _write(a.out, result, con)
            return 0

    # ---- the disk's own bandwidth, with the tier's I/O at the config's setting
    bench_io = disk_bandwidth(a.io_size, swap_root, cfg, con)
    if bench_io is not None:
        result["bench_io"] = bench_io
    baseline = import_baseline_rss()
    result["import_baseline_rss_bytes"] = baseline
    floor_samples, before = floor_before(a, cfg, overrides, con)  # (the rest of the floor after the run)

    # ---- the run
    returncode, sampler, run_dir, wall = run_sampled(a, cfg, overrides, swap_dirs, con)
    result["returncode"], result["wall_s"], result["run_dir"] = returncode, wall, str(run_dir)
    result["status"] = "ok" if returncode == 0 else "failed"
    result.update(measure(sampler, run_dir, result, baseline))
    # the floor and the prediction after the run: a failure there is recorded beside the run's figures
    try:
        if a.floor_depths and result["status"] == "ok":
            result["floor"] = measure_floor(a, cfg, overrides, result, con, floor_samples, before)
        if result["status"] == "ok" and result.get("bench_io"):
            result["prediction"] = predicted_step(cfg, est, result)
    except Exception as e:  # noqa: BLE001  (the run's own measurements are written whatever happens here)
        result["floor_error"] = f"{type(e).__name__}: {e}"
        con.print(f"[red]floor or prediction failed: {result['floor_error']}")
    print(title(result))
    sys.stdout.write(render(result))
    _write(a.out, result, con)
    return 0 if returncode == 0 else 1


def planned_result(
    ap: argparse.ArgumentParser, a: argparse.Namespace, overrides: list[str], cfg: Config,
    cpu: benchlib.CpuPrecision, sections: dict[str, Path], swap_dirs: list[Path],
) -> tuple[dict, Estimate, dict]:  # fmt: skip
    """The JSON's fields known before the run (the command, the model, its states against RAM, the swap
    folders, `zoff estimate`'s figures), with the estimate and its configured policy's row."""
    mem = meminfo()
    est, row, figures = configured_estimate(cfg, cpu.computed)
    states = data_parallel_bytes(est.trainable_params)
    ckpt_bytes = 12 * est.trainable_params if saves_final_checkpoint(cfg) else 0  # fp32 master + 2 moments
    result: dict = {
        **benchlib.provenance(),
        "command": benchlib.command_line(ap, a, "bench_beyond_memory"),
        "config": str(a.config), "size": a.size, "overrides": overrides, "nproc": cfg.launch.nproc_per_node,
        "params": est.params, "trainable_params": est.trainable_params, "precision": cfg.train.precision,
        "cpu_precision": cpu.to_json(),
        "model_state_bytes": states, "model_state_to_ram": states / mem["MemTotal"],
        "nvme_sections": {k: str(v) for k, v in sections.items()}, "swap_paths": [str(d) for d in swap_dirs],
        "estimate": figures,
        "final_checkpoint_bytes": ckpt_bytes,
    }  # fmt: skip
    return result, est, row


def run_sampled(
    a: argparse.Namespace, cfg: Config, overrides: list[str], swap_dirs: list[Path], con: Console
) -> tuple[int, Sampler, Path, float]:
    """`zoff train` as a subprocess, its processes sampled from /proc every --interval seconds until it ends:
    (its return code, the sampler, its run directory, its wall seconds)."""
    run_dir = a.run_dir or Path("runs/bench") / f"beyond-memory-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "zoff", "train", str(a.config), *overrides, "--run-dir", str(run_dir)]
    con.print("running: " + " ".join(cmd))
    dev = block_device(swap_dirs[0]) if swap_dirs else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    sampler = Sampler(proc.pid, swap_dirs, dev, run_dir / "metrics.jsonl", cfg.train.max_steps)
    while proc.poll() is None:
        sampler.sample()
        time.sleep(a.interval)
    sampler.sample()  # the last lines of metrics.jsonl
    return proc.returncode, sampler, run_dir, time.perf_counter() - t0


def floor_before(
    a: argparse.Namespace, cfg: Config, overrides: list[str], con: Console
) -> tuple[dict[int, list[float]], int]:
    """The floor's first rounds (half of --floor-rounds, rounded down), before the run: with the rest after
    it, the floor brackets the run, so a host whose speed moves during the job moves both alike (one round
    after the run measured 23.8 to 27.2 s over three runs of the same code and step). (samples, rounds)."""
    before = a.floor_rounds // 2 if a.floor_depths else 0
    samples: dict[int, list[float]] = {}
    if before:
        depths = tuple(int(x) for x in a.floor_depths.split(","))
        con.print(f"floor, before the run: n_layer {depths} with every state in RAM, {before} round(s) ...")
        measure_compute(a.config, overrides, depths, a.floor_steps, cfg.model.n_layer, before, samples,
                        native=a.native_precision)  # fmt: skip
    return samples, before


def measure_floor(
    a: argparse.Namespace, cfg: Config, overrides: list[str], result: dict, con: Console,
    samples: dict[int, list[float]] | None = None, before: int = 0,
) -> dict:  # fmt: skip
    """The step's floor in the same job (offload_floor.py): the config at two depths with every state in RAM,
    scaled to its depth, against the disk bytes this run moved per step at the raw bandwidth just measured;
    `before` rounds of it were measured before the run (`samples`), the rest now."""
    depths = tuple(int(x) for x in a.floor_depths.split(","))
    after = max(1, a.floor_rounds - before)
    con.print(
        f"floor: {a.config} at n_layer {depths} with every state in RAM, {a.floor_steps} steps each, "
        f"{after} round(s) after the run ..."
    )
    compute = measure_compute(
        a.config, overrides, depths, a.floor_steps, cfg.model.n_layer, after, samples, first_round=before,
        native=a.native_precision,
    )  # fmt: skip
    compute["rounds_before_run"] = before
    io, bio = result["disk_io_per_step"].get("ranks"), result.get("bench_io")
    out = {"compute": compute}
    if io and bio:
        read, write = device_gbps(bio)
        out |= floor(compute["scaled_s"], io["read_per_step"], io["write_per_step"], read, write)
        out |= {"read_gbps": read, "write_gbps": write}
        med = result.get("step_time_median_s")
        out["step_to_floor"] = med / out["floor_s"] if med else None
        phases, sp = compute.get("scaled_phases_s"), result.get("step_time_split") or {}
        if phases and "walk_read_bytes" in sp and med:  # the overlapped step: what an exact step can do here
            ob = overlapped_bound(phases, sp["walk_read_bytes"], sp["walk_written_bytes"], read, write)
            out |= {"overlapped_bound": ob, "step_to_overlapped_bound": med / ob["bound_s"]}
        out["disk_busy_fraction"] = out["disk_s"] / med if med else None  # at raw bandwidth, over the step
    return out


def device_gbps(bio: dict) -> tuple[float, float]:
    """The disk's bandwidth each way as this job measured it at its best: bench-io's raw sequential O_DIRECT
    or the engine's own swap, whichever moved more (on this VM's disk the swap, several regions in flight,
    reads about twice the raw sequential figure): a floor never assumes the disk slower than it was seen."""
    return (
        max(bio["raw_read_gbps"], bio["swap_read_gbps"]),
        max(bio["raw_write_gbps"], bio["swap_write_gbps"]),
    )


def predicted_step(cfg: Config, est, result: dict) -> dict:
    """`zoff estimate --time`'s step for the configured policy (its probes, run now on this box), with this
    job's raw disk bandwidth for the disk's rate, against the measured median step."""
    from zoff.planning.estimate import step_timing

    bio = result["bench_io"]
    rates, steps = step_timing(cfg, est, cfg.launch.nproc_per_node)
    read, write = device_gbps(bio)
    rates = dataclasses.replace(rates, read_gbps=read, write_gbps=write)
    from zoff.planning import step_time

    pieces, shard = step_time.plan_inputs(cfg.model, cfg.zero, est.world_size)
    pe = next(p for p in est.policies if p.policy.name == result["estimate"]["policy"]
              and p.policy.activation_checkpointing == cfg.train.activation_checkpointing)  # fmt: skip
    st = step_time.predict(
        pe, pieces[pe.policy.stage], rates, cfg.train.grad_accum, shard[pe.policy.stage],
        cfg.zero.offload_optimizer.overlap_step, shared_cores=True, delayed=cfg.zero.offload_optimizer.delay_update,
    )  # fmt: skip
    med = result.get("step_time_median_s")
    return {"forward_backward_s": st.forward_backward_s, "optimizer_s": st.optimizer_s, "step_s": st.step_s,
            "bound": st.bound, "compute_s_per_micro_batch": rates.compute_s,
            "adam_s_per_param": rates.adam_s_per_param, "read_gbps": rates.read_gbps,
            "write_gbps": rates.write_gbps, "diff_pct": 100 * (st.step_s - med) / med if med else None,
            # the row speculates: its step when the clip does not trigger (every speculated unit committed)
            "speculated_step_s": st.speculated.step_s if st.speculated is not None else None}  # fmt: skip


def _write(out: Path, result: dict, con: Console) -> None:
    """The results, and beside them the RSS time series: ~2500 samples of an hour's run would be most of the
    JSON, and the table reads only their peaks, which the results hold."""
    out.parent.mkdir(parents=True, exist_ok=True)
    series = result.pop("series", None)
    out.write_text(json.dumps(result, indent=2) + "\n")
    con.print(f"wrote {out}")
    if series is not None:
        beside = out.with_suffix(".series.json")
        lines = ",\n".join(json.dumps(row) for row in series["rows"])  # a sample a line: diffable, compact
        beside.write_text(f'{{"columns": {json.dumps(series["columns"])},\n"rows": [\n{lines}\n]}}\n')
        con.print(f"wrote {beside}")


if __name__ == "__main__":
    sys.exit(main())
