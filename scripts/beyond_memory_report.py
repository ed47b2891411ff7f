"""The reporting side of scripts/bench_beyond_memory.py: the measured results (from the Sampler, metrics.jsonl
and the rank logs) set against the estimate, as the JSON's fields and as the markdown table the script prints
and the docs embed (render, from the JSON alone)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import benchlib
from beyond_memory_probe import Sampler, per_step_io

from zoff.units import human

GB = 1e9


def engine_stats(run_dir: Path) -> dict[str, dict]:
    """The 'engine stats' line each rank logs at the end (its last step's optimizer/publish times)."""
    out = {}
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        for line in log.read_text().splitlines():
            if " engine stats " in line:
                out[log.stem] = json.loads(line.split(" engine stats ", 1)[1])
    return out


def pct(measured: float, predicted: float) -> float | None:
    return None if not predicted else 100.0 * (measured - predicted) / predicted


SPLIT = (  # (key, label): the parts of a step, from rank 0's records in metrics.jsonl
    ("compute_s", "compute"),  # forward/backward compute (and everything else)
    ("param_read_wait_s", "parameter-read wait"),  # waiting for parameter shards read from disk (gathers)
    ("optimizer_disk_wait_s", "optimizer disk wait"),  # the optimizer waiting for its states' I/O
    ("adam_s", "CPU Adam"),  # the optimizer's CPU Adam and conversions
    ("param_write_wait_s", "parameter write-back wait"),  # the optimizer waiting for parameter write-backs
    ("publish_s", "publish"),  # all-gather of persistent params, last write-back
)


def step_split(steps: list[dict], delayed: bool = False) -> dict:
    """Median seconds of each part of a step over `steps` (metrics.jsonl records carry the engine's timings
    and swap-file waits); empty without them. `delayed` (delay_update): the walk runs beside the next forward
    and backward, and a step waits for the last one only where it is the longer (dpu_wait_s)."""
    if not steps or "optimizer_s" not in steps[0]:
        return {}
    if delayed:
        out = {"steps": [x["step"] for x in steps]}
        for key in ("step_time_s", "last_walk_s", "dpu_wait_s", "disk_optimizer_wait_s", "disk_grads_wait_s",
                    "disk_params_read_wait_s"):  # fmt: skip
            out[key] = statistics.median(x.get(key, 0.0) for x in steps)
        out["note"] = ("medians over the steps listed, rank 0; delay_update: each step's optimizer walk runs "
                       "beside the next step's forward and backward, which waits for it (dpu_wait_s) only "
                       "where it is the longer; the walk's disk waits are within it")  # fmt: skip
        return out
    parts: dict[str, list[float]] = {k: [] for k, _ in SPLIT}
    overlapped = any(x.get("last_walk_s") for x in steps)
    for x in steps:
        read_wait = x.get("disk_params_read_wait_s", 0.0)
        param_write = x.get("disk_params_wait_s", 0.0) - read_wait
        opt_wait = x.get("disk_optimizer_wait_s", 0.0)
        parts["compute_s"].append(x["step_time_s"] - x["optimizer_s"] - x["publish_s"] - read_wait)
        parts["param_read_wait_s"].append(read_wait)
        parts["optimizer_disk_wait_s"].append(opt_wait)
        # the overlapped step: the walk runs beside the next forward (its own time, its waits within it)
        own = x["last_walk_s"] - x.get("disk_grads_wait_s", 0.0) if overlapped else x["optimizer_s"]
        parts["adam_s"].append(own - opt_wait - param_write)
        parts["param_write_wait_s"].append(param_write)
        parts["publish_s"].append(x["publish_s"])
    out = {
        "steps": [x["step"] for x in steps],
        **{k: statistics.median(v) for k, v in parts.items()},
        "note": "medians over the steps listed, rank 0; compute is the step less the rest",
    }
    for key in ("forward_s", "backward_s"):  # (the trainer's record has them since this session)
        if all(key in x for x in steps):
            out[key] = statistics.median(x[key] for x in steps)
    out |= _speculation_split(steps)
    if overlapped:
        out["walk_s"] = statistics.median(x["last_walk_s"] for x in steps)
        # the walk's bytes: the streamed states each way, the gradient shard read, the parameter shards written
        out["walk_read_bytes"] = statistics.median(
            x.get("disk_optimizer_read_bytes", 0) + x.get("disk_grads_read_bytes", 0) for x in steps
        )
        out["walk_written_bytes"] = statistics.median(
            x.get("disk_optimizer_written_bytes", 0) + x.get("disk_params_written_bytes", 0) for x in steps
        )
        out["note"] = ("medians over the steps listed, rank 0; the optimizer's walk runs beside the next "
                       "forward: compute is the step less the parameter reads (the forward's waits for the "
                       "walk included), and the walk's parts are within the walk")  # fmt: skip
    return out


def _speculation_split(steps: list[dict]) -> dict:
    """Exact speculation's share of the steps (zero.offload_optimizer.speculate): units speculated and committed
    (medians per step, of spec_units), and the swap bytes moved while backward computed (medians)."""
    out = {}
    if all("spec_units" in x for x in steps):
        out |= {"spec_units": steps[0]["spec_units"],
                "spec_speculated": statistics.median(x["spec_speculated_units"] for x in steps),
                "spec_committed": statistics.median(x["spec_committed_units"] for x in steps)}  # fmt: skip
    if all("backward_disk_read_bytes" in x for x in steps):
        out |= {"backward_read_bytes": statistics.median(x["backward_disk_read_bytes"] for x in steps),
                "backward_written_bytes": statistics.median(x["backward_disk_written_bytes"] for x in steps)}  # fmt: skip
    return out


def speculation_rows(sp: dict, fl: dict | None) -> list[list[str]]:
    """The table's rows for speculation: units committed per step, and the disk's busy share of backward (its
    bytes then at the raw bandwidth the floor uses, over backward's time)."""
    rows = []
    if sp.get("spec_units"):
        rows.append(["speculation: units speculated beside backward / committed / trainable units (medians a step)",
                     f"{sp['spec_speculated']:.0f} / {sp['spec_committed']:.0f} / {sp['spec_units']}"
                     f" ({sp['spec_committed'] / sp['spec_units']:.0%} committed)", "", ""])  # fmt: skip
    if fl and "read_gbps" in fl and sp.get("backward_s") and "backward_read_bytes" in sp:
        busy = (sp["backward_read_bytes"] / (fl["read_gbps"] * 1e9)
                + sp["backward_written_bytes"] / (fl["write_gbps"] * 1e9)) / sp["backward_s"]  # fmt: skip
        rows.append(["disk busy during backward: its bytes then (read "
                     f"{sp['backward_read_bytes'] / 1e9:.1f} GB, written {sp['backward_written_bytes'] / 1e9:.1f} GB) "
                     "at that bandwidth / backward", f"{min(busy, 1.0):.0%}", "", ""])  # fmt: skip
    return rows


def measure(s: Sampler, run_dir: Path, r: dict, baseline: int) -> dict:
    """The measured side of the table from the sampler, metrics.jsonl and the rank logs."""
    steps = [x for x in s.records if "loss" in x and "event" not in x]
    procs = s.per_process()
    ranks = sorted((p for p in procs if p["role"].startswith("rank")), key=lambda p: int(p["role"][4:]))
    launcher = next((p for p in procs if p["role"] == "launcher"), None)
    stats = engine_stats(run_dir)
    ranks_io, device_io = per_step_io(s.snapshots, "ranks_io"), per_step_io(s.snapshots, "device_io")
    times = [x["step_time_s"] for x in steps]
    steady = times[1:] or times
    delayed = any(
        o.replace(" ", "") == "zero.offload_optimizer.delay_update=true" for o in r.get("overrides", [])
    )
    split = step_split(steps[1:] or steps, delayed)
    io_measured = {}
    for name, src in (("ranks", ranks_io), ("device", device_io)):
        if src is not None:
            sec = src["seconds_per_step"] or None
            io_measured[name] = {
                **src,
                "read_gbps_over_step": src["read_per_step"] / sec / GB if sec else None,
                "write_gbps_over_step": src["write_per_step"] / sec / GB if sec else None,
            }
    est = r["estimate"]
    growth = s.peak("ranks", "train") - len(ranks) * baseline
    mem_total = r["machine"]["ram_bytes"]
    per_step = lambda key: ranks_io[key] if ranks_io else None  # noqa: E731
    return {
        "samples": s.samples,
        "processes": procs,
        "peak_rss_per_rank_bytes": {p["role"]: p["peak_rss_train_bytes"] for p in ranks},
        "peak_rss_launcher_bytes": launcher["peak_rss_bytes"] if launcher else 0,
        "peak_rss_job_bytes": s.peak("job", "train"),
        "peak_rss_job_to_ram": s.peak("job", "train") / mem_total,
        "peak_rss_ranks_bytes": s.peak("ranks", "train"),
        "peak_rss_ranks_above_import_baseline_bytes": growth,
        "page_cache_growth_bytes": s.peak("cache", "train"),
        "end_phase": {  # the final evaluation and the checkpoint zoff train saves at the last step
            "peak_rss_job_bytes": s.peaks["end"]["job"],
            "peak_rss_per_rank_bytes": {p["role"]: max(p["peak_rss_bytes"], p["vm_hwm_bytes"]) for p in ranks},
            "page_cache_growth_bytes": s.peaks["end"]["cache"],
        },
        "swap_files_peak_bytes": s.peak("swap"),
        "ranks_io_total": {k: sum(p[f"{k}_bytes"] for p in ranks) for k in ("read", "write")},
        "disk_io_per_step": io_measured,
        "steps": [{k: x.get(k) for k in ("step", "loss", "step_time_s", "grad_norm", "lr", "peak_rss_mib")}
                  for x in steps],  # fmt: skip
        "val_loss": next((x["val_loss"] for x in reversed(s.records) if "val_loss" in x), None),
        "step_time_median_s": statistics.median(steady) if steady else None,
        "step_time_split": split,
        "engine_stats": stats,
        "series": {"columns": ["t_s", "phase", "job_rss", "ranks_rss", "page_cache_growth", "swap_bytes"],
                   "rows": s.series},  # fmt: skip
        "vs_estimate": {
            "ram_bytes": {"predicted": est["ram_bytes"], "measured": growth, "diff_pct": pct(growth, est["ram_bytes"]),
                          "measured_is": "the ranks' summed peak RSS during training less their import baseline"},
            "disk_bytes": {"predicted": est["disk_bytes"], "measured": s.peak("swap"),
                           "diff_pct": pct(s.peak("swap"), est["disk_bytes"])},
            "disk_read_per_step": {"predicted": est["disk_read_bytes_per_step"], "measured": per_step("read_per_step"),
                                   "diff_pct": pct(per_step("read_per_step") or 0, est["disk_read_bytes_per_step"]) if ranks_io else None},
            "disk_written_per_step": {"predicted": est["disk_written_bytes_per_step"], "measured": per_step("write_per_step"),
                                      "diff_pct": pct(per_step("write_per_step") or 0, est["disk_written_bytes_per_step"]) if ranks_io else None},
        },
        "missing_from_trainer": MISSING,
    }  # fmt: skip


MISSING = [
    "every rank's peak RSS per step (metrics.jsonl carries the largest rank's and which rank; this script "
    "samples every process's /proc instead)",
]


def title(r: dict) -> str:
    size = f" --size {r['size']}" if r["size"] else ""
    return (
        f"zoff beyond memory: {Path(r['config']).name}{size}, {r['nproc']} rank(s), "
        f"{r['precision']}{benchlib.computed_in(r)}, "
        f"{r['estimate']['policy']}, {r['date']}"
    )


def render(r: dict) -> str:
    """The markdown table: what the job used (RAM, page cache, disk, time) against `zoff estimate`; pure."""
    if r.get("status") != "ok":
        return f"Not measured: {r.get('status', 'unknown')}.\n\n" + benchlib.measured_line(
            r, "bench_beyond_memory"
        )
    head = _head(r)
    sp, med = r["step_time_split"], r["step_time_median_s"]
    fl = r.get("floor")
    fl = fl if fl and "floor_s" in fl else None  # (a floor that failed or was skipped shows no rows)
    rows = [
        *_memory_rows(r),
        *_disk_rate_rows(r),
        *_host_budget_rows(r["estimate"]),
        *_step_time_rows(sp, med),
        *_floor_rows(fl),
        *speculation_rows(sp or {}, fl),
        *_prediction_rows(r.get("prediction"), med),
        _loss_row(r),
    ]
    table = benchlib.md_table(["", "measured", "`zoff estimate`", "diff"], rows)
    return head + table + "\n" + benchlib.measured_line(r, "bench_beyond_memory")


def _bytes_cell(x: float | None) -> str:
    return "-" if x is None else human(int(x))


def _pct_cell(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _f2_cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _head(r: dict) -> str:
    """The line above the table: the model, its precision, the policy, the ranks and the steps."""
    size = f" `--size {r['size']}`" if r["size"] else ""
    return (
        f"`{Path(r['config']).name}`{size}: {r['params']:,} parameters, {r['precision']}{benchlib.computed_in(r)}, "
        f"`{r['estimate']['policy']}`, "
        f"{r['nproc']} rank(s), {len(r['steps'])} steps.\n\n"
    )


def _memory_rows(r: dict) -> list[list[str]]:
    """The rows of what the job held: model states against RAM, peak RSS, page cache, swap files, and the
    disk bytes each step moved, against the estimate's."""
    b, p, v, ram = _bytes_cell, _pct_cell, r["vs_estimate"], r["machine"]["ram_bytes"]
    parts = [f"{role} {b(x)}" for role, x in r["peak_rss_per_rank_bytes"].items()]
    parts.append(f"launcher {b(r['peak_rss_launcher_bytes'])}")
    job = f"**{b(r['peak_rss_job_bytes'])}, {r['peak_rss_job_to_ram']:.1%} of RAM** ({', '.join(parts)})"
    ranks, end, disk = v["ram_bytes"], r["end_phase"], v["disk_bytes"]
    rd, wr = v["disk_read_per_step"], v["disk_written_per_step"]
    return [
        ["model states (16 B/param) / RAM",
         f"{b(r['model_state_bytes'])} / {b(ram)} = **{r['model_state_to_ram']:.2f}x**", "", ""],
        ["peak RSS of the whole job (ranks + launcher, training)", job, "", ""],
        [f"the ranks' RSS less their import baseline ({b(r['import_baseline_rss_bytes'])} each)",
         b(ranks["measured"]), b(ranks["predicted"]), p(ranks["diff_pct"])],
        ["page-cache growth while training (peak)", b(r["page_cache_growth_bytes"]), "", ""],
        ["after the last step (eval, checkpoint): peak RSS of the job / page-cache growth",
         f"{b(end['peak_rss_job_bytes'])} / {b(end['page_cache_growth_bytes'])}", "", ""],
        ["swap files on disk (peak)", b(disk["measured"]), b(disk["predicted"]), p(disk["diff_pct"])],
        ["disk read / written per step (ranks)", f"{b(rd['measured'])} / {b(wr['measured'])}",
         f"{b(rd['predicted'])} / {b(wr['predicted'])}", f"{p(rd['diff_pct'])} / {p(wr['diff_pct'])}"],
    ]  # fmt: skip


def _disk_rate_rows(r: dict) -> list[list[str]]:
    """The ranks' disk GB/s over the step, beside what `zoff bench-io` measured on the same path."""
    io, bio = r["disk_io_per_step"].get("ranks"), r.get("bench_io")
    if not io:
        return []
    f2 = _f2_cell
    cell = f"{f2(io['read_gbps_over_step'])} / {f2(io['write_gbps_over_step'])}"
    if bio:
        cell += (
            f" (`zoff bench-io` on the same path: raw {f2(bio['raw_read_gbps'])} / {f2(bio['raw_write_gbps'])}"
            f", engine swap {f2(bio['swap_read_gbps'])} / {f2(bio['swap_write_gbps'])})"
        )
    return [["disk GB/s over the step, read / write (ranks)", cell, "", ""]]


def _host_budget_rows(est: dict) -> list[list[str]]:
    """The optimizer states the host budget keeps in RAM (none without zero.offload_optimizer.host_budget)."""
    hb, b = est.get("host_budget"), _bytes_cell
    if not hb:
        return []
    budget = "min (the working set)" if hb["budget_bytes"] is None else b(hb["budget_bytes"]) + " per rank"
    return [["host budget (zero.offload_optimizer.host_budget): optimizer states kept in RAM",
             f"{budget}: {b(hb['resident_state_bytes'])} of {b(hb['state_bytes'])} "
             f"({hb['resident_pieces']} of {hb['pieces']} sub-groups); gradient shard "
             f"{'on disk' if hb['grads_on_disk'] else 'in RAM'}", "", ""]]  # fmt: skip


def _step_time_rows(sp: dict, med: float | None) -> list[list[str]]:
    """The median step and what it was spent on (none where no step was timed)."""
    if med is None:
        return []
    split = _split_text(sp)
    steps = f"steps {sp['steps'][0]}-{sp['steps'][-1]}" if sp else "steps 2.."
    return [[f"step time (median of {steps}), s", f"{med:.1f}" + (f": {split}" if split else ""), "", ""]]


def _split_text(sp: dict) -> str:
    """The step's parts in words, as step_split measured them: the serial step's SPLIT, the delayed update's
    walk beside forward and backward, or the overlapped step's walk beside the next forward."""
    split = ", ".join(f"{label} {sp[k]:.2f}" for k, label in SPLIT) if sp and "adam_s" in sp else ""
    if sp and "dpu_wait_s" in sp:  # delay_update: the walk beside the next forward and backward
        split = (f"delayed update (params one step stale): the walk {sp['last_walk_s']:.2f} s (its "
                 f"optimizer disk wait {sp['disk_optimizer_wait_s']:.2f}, gradient reads "
                 f"{sp['disk_grads_wait_s']:.2f}) beside forward and backward, which waited "
                 f"{sp['dpu_wait_s']:.2f} for it; parameter-read wait {sp['disk_params_read_wait_s']:.2f}")  # fmt: skip
    elif sp and "walk_s" in sp:  # the overlapped step: the walk's own time runs beside the next forward
        inner = ", ".join(f"{label} {sp[k]:.2f}" for k, label in SPLIT[2:5])
        if sp.get("spec_speculated"):  # the files' wait counters add the worker's waits during backward
            inner = "not split: the swap files' waits include the speculation's worker's during backward"
        split = (f"forward and backward {sp['compute_s']:.2f} (the forward beside the previous step's "
                 f"optimizer walk, {sp['walk_s']:.2f} s: {inner}), parameter-read wait "
                 f"{sp['param_read_wait_s']:.2f}, publish {sp['publish_s']:.2f}")  # fmt: skip
    return split


def _floor_rows(fl: dict | None) -> list[list[str]]:
    """The step against its floor (compute + CPU Adam in RAM, and the disk's bytes at its best bandwidth), and
    against the overlapped step's bound where the run measured one."""
    if fl is None:
        return []
    c = fl["compute"]
    depths = " and ".join(f"{d} layers {c['step_s'][str(d)]:.2f} s" for d in c["depths"])
    if c.get("rounds", 1) > 1:
        depths += f", medians of {c['rounds']} alternating runs each"
    if c.get("rounds_before_run"):
        depths += f", {c['rounds_before_run']} of them before this run and the rest after it"
    rows = [
        [f"floor: compute + CPU Adam with every state in RAM ({depths}; scaled to {c['layers']}), s",
         f"{fl['compute_adam_s']:.1f}", "", ""],
        [f"floor: this run's disk bytes per step at the disk's best bandwidth above ({fl['read_gbps']:.2f} / "
         f"{fl['write_gbps']:.2f} GB/s), s", f"{fl['disk_s']:.1f}", "", ""],
        [f"step / floor (bound by {fl['bound']})", f"**{fl['step_to_floor']:.2f}x**", "", ""],
        ["disk busy: its bytes at that bandwidth / the step", f"{fl['disk_busy_fraction']:.0%}", "", ""],
    ]  # fmt: skip
    ob = fl.get("overlapped_bound")
    if ob:  # what an exact step can do under this budget (offload_floor.overlapped_bound)
        rows.append([
            "the overlapped step's bound: backward with every state in RAM, then the longer of the forward + "
            "CPU Adam (in RAM) and the walk's bytes at that bandwidth, s",
            f"{ob['bound_s']:.1f} = {ob['backward_s']:.1f} + max({ob['forward_adam_s']:.1f}, "
            f"{ob['walk_disk_s']:.1f}); step / bound **{fl['step_to_overlapped_bound']:.2f}x**, bound / floor "
            f"{ob['bound_s'] / fl['floor_s']:.2f}x", "", "",
        ])  # fmt: skip
    return rows


def _prediction_rows(pr: dict | None, med: float | None) -> list[list[str]]:
    """The median step against `zoff estimate --time`'s, and against its step when every speculated unit
    commits (none without a prediction or a timed step)."""
    if not pr or med is None:
        return []
    first, second = (
        ("backward", "the walk beside the forward")
        if pr["bound"].startswith("backward")
        else ("forward+backward", "optimizer")
    )  # (the overlapped step's two phases)
    rows = [[f"step time predicted by `zoff estimate --time` ({pr['bound']}), s",
             f"{med:.1f}", f"{pr['step_s']:.1f} ({first} {pr['forward_backward_s']:.1f}, "
             f"{second} {pr['optimizer_s']:.1f})", _pct_cell(pr["diff_pct"])]]  # fmt: skip
    if pr.get("speculated_step_s") is not None:  # (what --time predicts when every speculated unit commits)
        rows.append(["... predicted when the clip does not trigger (every speculated unit committed), s",
                     f"{med:.1f}", f"{pr['speculated_step_s']:.1f}",
                     _pct_cell(100 * (pr["speculated_step_s"] - med) / med)])  # fmt: skip
    return rows


def _loss_row(r: dict) -> list[str]:
    """The loss of every step, and the final evaluation's where there was one."""
    losses = " ".join(f"{x['loss']:.2f}" for x in r["steps"])
    val = f" (val {r['val_loss']:.2f})" if r.get("val_loss") is not None else ""
    return [f"loss, steps {r['steps'][0]['step']}-{r['steps'][-1]['step']}" if r["steps"] else "loss",
            losses + val, "", ""]  # fmt: skip
