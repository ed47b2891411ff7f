"""bench_offload.py's results: the ranks' per-step records reduced to the JSON's summary (per variant and per round,
ratios as medians with quartiles, what DPU hid, the probes), the console table and the markdown tables the docs
embed (pure functions of the records and the JSON)."""

from __future__ import annotations

import statistics

import benchlib
from rich.console import Console
from rich.table import Table

VARIANTS = ("stage2", "offload", "dpu")
# the seconds bench_offload.run_step records per step (besides cpu_steps and clipped)
PHASES = ("fwd", "bwd", "step", "total", "optimizer", "publish", "wait", "join", "publish_m", "cpu_step")


# --------------------------------------------------------------------------------------- reduction
def quartiles(xs: list[float]) -> list[float]:
    """q1, q3 (statistics' default method, clamped to the data: with 2-3 rounds it would extrapolate)."""
    if len(xs) < 2:
        return xs * 2
    return [min(max(q, min(xs)), max(xs)) for q in statistics.quantiles(xs, n=4)[::2]]


def med_q(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "q1_q3": quartiles(xs)}


def ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def per_round(per_rank: list[dict], k: str, p: str, agg=statistics.fmean) -> list[float]:
    """Variant k's phase p, per round: `agg` over ranks of the mean over the round's timed steps."""
    return [
        agg(statistics.fmean(s[p] for s in pr["rounds"][r][k]) for pr in per_rank)
        for r in range(len(per_rank[0]["rounds"]))
    ]


def fwd_bwd(phases: dict[str, list[float]]) -> list[float]:
    """One variant's forward + backward, per round."""
    return [f + b for f, b in zip(phases["fwd"], phases["bwd"])]


def mean_over_steps(per_rank: list[dict], k: str, key: str) -> float:
    """`key` of variant k averaged over every timed step of every round on every rank."""
    return statistics.fmean(s[key] for pr in per_rank for rd in pr["rounds"] for s in rd[k])


def slowest_rank(probes: list[dict], key: str, reps: int) -> list[float]:
    """A probe's `key` per repetition, the slowest rank's: the ranks start each repetition together at a
    barrier, so a repetition ends when the slowest rank ends."""
    return [max(p[key][i] for p in probes) for i in range(reps)]


def variant_summary(per_rank: list[dict], k: str, step: dict[str, list[float]], phases: dict) -> dict:
    """Variant k's entry of the summary, from every variant's per-round step times and phases."""
    v = phases[k]
    return {
        "ms_per_step": 1e3 * statistics.median(step[k]),
        "ms": {p: 1e3 * statistics.median(v[p]) for p in PHASES},
        "fwd_bwd_ms": 1e3 * statistics.median(fwd_bwd(v)),
        # grad norm, clipping, grad conversion: step() minus what the engine's timers cover
        "step_other_ms": 1e3
        * statistics.median(
            [s - o - p - w for s, o, p, w in zip(*(v[x] for x in ("step", "optimizer", "publish", "wait")))]
        ),
        "vs_stage2": med_q(ratios(step[k], step["stage2"])),
        "cpu_step_share": med_q(ratios(v["optimizer"], v["total"])),
        "fwd_bwd_vs_stage2": med_q(ratios(fwd_bwd(v), fwd_bwd(phases["stage2"]))),
        "clipped_fraction": mean_over_steps(per_rank, k, "clipped"),
        "per_round_ms": [1e3 * t for t in step[k]],
    }


def dpu_summary(per_rank: list[dict], step: dict[str, list[float]], phases: dict) -> dict:
    """How much of the synchronous CPU step (the offload variant's, same round) DPU's overlap hid. The join
    wait is measured around optimizer.finish(); the engine's dpu_wait_s also counts the publish of the
    delayed update (copy + all-gather), which is not CPU-step time, so it is reported beside it."""
    dpu, sync_cpu = phases["dpu"], phases["offload"]["optimizer"]
    return {
        "hidden_fraction": med_q([1 - w / o for w, o in zip(dpu["join"], sync_cpu)]),
        "hidden_fraction_engine_wait": med_q([1 - w / o for w, o in zip(dpu["wait"], sync_cpu)]),
        # the overlapped CPU step's own duration, over the same step run synchronously
        "bg_cpu_step_vs_sync": med_q(ratios(dpu["cpu_step"], phases["offload"]["cpu_step"])),
        "bg_cpu_step_ms": 1e3 * statistics.median(dpu["cpu_step"]),
        "cpu_steps_per_timed_step": mean_over_steps(per_rank, "dpu", "cpu_steps"),
        "vs_offload": med_q(ratios(step["dpu"], step["offload"])),
        # what the step saved, as a fraction of the synchronous CPU step it tried to hide
        "saved_of_cpu_step": med_q(
            [(so - sd) / o for so, sd, o in zip(step["offload"], step["dpu"], sync_cpu)]
        ),
    }


def copy_out_summary(probes: list[dict]) -> dict:
    """The bf16 copy-out probe (bench_offload.copy_out_probe) of every rank that ran it."""
    reps = len(probes[0]["fused_s"])
    sep = slowest_rank(probes, "separate_s", reps)
    fused = slowest_rank(probes, "fused_s", reps)
    return {
        "separate_ms": 1e3 * statistics.median(sep),
        "fused_ms": 1e3 * statistics.median(fused),
        "fused_vs_separate": med_q(ratios(fused, sep)),
        "shard_numel_rank0": probes[0]["numel"],
    }


def step_overhead_summary(probes: list[dict]) -> dict:
    """The step() overhead probe (bench_offload.step_overhead_probe) of every rank."""
    reps = len(probes[0]["norm_engine_s"])
    worst = {k: slowest_rank(probes, k, reps) for k in probes[0]}
    return {
        **{k.replace("_s", "_ms"): 1e3 * statistics.median(v) for k, v in worst.items()},
        "norm_vector_norm_vs_engine": med_q(ratios(worst["norm_vector_norm_s"], worst["norm_engine_s"])),
    }


def summarize(per_rank: list[dict]) -> dict:
    """One job's summary (the JSON's jobs[].summary) from its ranks' timing_rank records."""
    # A step ends when the slowest rank ends: the step time of a round is the max over ranks.
    step = {k: per_round(per_rank, k, "total", max) for k in VARIANTS}
    phases = {k: {p: per_round(per_rank, k, p) for p in PHASES} for k in VARIANTS}
    out: dict = {"variants": {k: variant_summary(per_rank, k, step, phases) for k in VARIANTS}}
    out["dpu"] = dpu_summary(per_rank, step, phases)
    out["offload_vs_stage2_optimizer"] = med_q(
        ratios(phases["offload"]["optimizer"], phases["stage2"]["optimizer"])
    )
    out["info_rank0"] = per_rank[0]["info"]
    out["threads_per_rank"] = per_rank[0]["threads"]
    probes = [pr["copy_out_probe"] for pr in per_rank if pr["copy_out_probe"]]
    if probes:
        out["copy_out_probe"] = copy_out_summary(probes)
    out["step_overhead_probe"] = step_overhead_summary([pr["step_overhead_probe"] for pr in per_rank])
    return out


# ------------------------------------------------------------------------------------------- output
def fmt_q(d: dict, pct: bool = False) -> str:
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.2f}")  # noqa: E731
    lo, hi = d["q1_q3"]
    sep = " to " if min(lo, hi) < 0 else "-"  # "-343%-90%" would read as a range of two negatives
    return f"{f(d['median'])} ({f(lo)}{sep}{f(hi)})"


def print_table(result: dict) -> None:
    con = Console(width=max(160, Console().width))
    mc = result["machine"]
    con.print(
        f"[bold]zoff offload benchmark[/]: GPT {result['params'] / 1e6:.1f}M params, ZeRO stage 2, batch "
        f"{result['args']['batch']}x{result['args']['seq_len']} tokens per rank; {mc['cpu']}, {mc['cores']} "
        f"cores, torch {mc['torch']}, CPU Adam {mc['cpu_adam']['backend']} ({mc['cpu_adam']['simd']})"
    )
    tab = Table(
        title="ms: medians over rounds, for scale only; ratios, shares: median (q1-q3) of per-round values"
    )
    cols = ("ranks", "prec", "variant", "ms/step", "x stage2", "fwd+bwd", "CPU step", "publish")
    cols += ("DPU wait", "other", "CPU-step share", "DPU hidden")
    for c in cols:
        tab.add_column(c, justify="right", no_wrap=True)
    for job in result["jobs"]:
        s = job["summary"]
        for k in VARIANTS:
            v = s["variants"][k]
            share = "(launch only)" if k == "dpu" else fmt_q(v["cpu_step_share"], pct=True)
            ms = (
                v["ms_per_step"],
                v["fwd_bwd_ms"],
                *(v["ms"][p] for p in ("optimizer", "publish_m", "join")),
            )
            tab.add_row(
                str(job["world"]),
                job["precision"],
                k,
                f"{ms[0]:.0f}",
                fmt_q(v["vs_stage2"]),
                *(f"{x:.0f}" for x in ms[1:]),
                f"{v['step_other_ms']:.0f}",
                share,
                fmt_q(s["dpu"]["hidden_fraction"], pct=True) if k == "dpu" else "",
                end_section=k == VARIANTS[-1],
            )
    con.print(tab)
    for job in result["jobs"]:
        s = job["summary"]
        line = (
            f"{job['world']} rank(s) {job['precision']}: zoff CPU Adam / torch fused AdamW (optimizer_s) "
            f"{fmt_q(s['offload_vs_stage2_optimizer'])}; dpu / offload step {fmt_q(s['dpu']['vs_offload'])}; "
            f"DPU saved {fmt_q(s['dpu']['saved_of_cpu_step'], pct=True)} of the sync CPU step; fwd+bwd vs stage2: "
            f"offload {fmt_q(s['variants']['offload']['fwd_bwd_vs_stage2'])}, "
            f"dpu {fmt_q(s['variants']['dpu']['fwd_bwd_vs_stage2'])}; clipped steps "
            f"{max(v['clipped_fraction'] for v in s['variants'].values()):.0%}"
        )
        d, o = s["dpu"], s["step_overhead_probe"]
        line += (
            f"\n    DPU: the overlapped CPU step took {d['bg_cpu_step_ms']:.0f} ms, "
            f"{fmt_q(d['bg_cpu_step_vs_sync'])} x the synchronous one; engine dpu_wait_s "
            f"{s['variants']['dpu']['ms']['wait']:.0f} ms (join + publish) -> hidden "
            f"{fmt_q(d['hidden_fraction_engine_wait'], pct=True)}"
            f"\n    step() overhead probe: norm as engine {o['norm_engine_ms']:.0f} ms, with vector_norm "
            f"{o['norm_vector_norm_ms']:.0f} ms; clip as engine {o['clip_engine_ms']:.0f} ms"
        )
        if "copy_out_probe" in s:
            p = s["copy_out_probe"]
            line += (
                f"\n    copy-out probe: kernel + separate bf16 copy {p['separate_ms']:.0f} ms, kernel with fused "
                f"out16 {p['fused_ms']:.0f} ms, fused/separate {fmt_q(p['fused_vs_separate'])}"
            )
        con.print(line)


def render(data: dict) -> str:
    """The markdown tables the docs embed: each job's variants (ms for scale, ratios and shares as medians
    (q1-q3) of per-round values), then what each job says of zoff's CPU Adam and of DPU; pure."""
    a, mc = data["args"], data["machine"]
    out = [
        f"{data['params'] / 1e6:.1f}M-parameter GPT ({a['layers']} layers x {a['d_model']}), ZeRO stage 2, batch "
        f"{a['batch']}x{a['seq_len']} tokens per rank, {a['rounds']} interleaved rounds of {a['steps_per_round']} "
        f"timed steps, gradient clipping at {a['grad_clip']}; CPU Adam {mc['cpu_adam']['backend']} "
        f"({mc['cpu_adam']['simd']}). ms are medians over rounds, for scale only; ratios and shares are medians "
        "(q1-q3) of per-round values. CPU step: the optimizer's time in step() (under DPU only the gradient copy "
        "and the launch); DPU join: the wait for the delayed CPU step; other: the gradient norm and clipping.\n\n"
    ]
    header = [
        "ranks",
        "precision",
        "variant",
        "ms/step",
        "/ stage2",
        "fwd+bwd ms",
        "CPU step ms",
        "publish ms",
    ]
    header += ["DPU join ms", "other ms", "CPU-step share", "DPU hidden"]
    rows = []
    for job in data["jobs"]:
        s = job["summary"]
        for k in VARIANTS:
            v = s["variants"][k]
            ms = (v["ms_per_step"], v["fwd_bwd_ms"], v["ms"]["optimizer"], v["ms"]["publish_m"])
            rows.append(
                [str(job["world"]), job["precision"], k, f"{ms[0]:.0f}", fmt_q(v["vs_stage2"])]
                + [f"{x:.0f}" for x in ms[1:]]
                + [f"{v['ms']['join']:.0f}" if k == "dpu" else "", f"{v['step_other_ms']:.0f}"]
                + ["(launch only)" if k == "dpu" else fmt_q(v["cpu_step_share"], pct=True)]
                + [fmt_q(s["dpu"]["hidden_fraction"], pct=True) if k == "dpu" else ""]
            )
    out += [benchlib.md_table(header, rows), "\n"]
    header = ["ranks", "precision", "zoff CPU Adam / torch fused AdamW", "DPU step / offload step"]
    header += ["DPU saved, of the sync CPU step", "fwd+bwd / stage2: offload, dpu", "clipped steps"]
    rows = []
    for job in data["jobs"]:
        s = job["summary"]
        fb = (fmt_q(s["variants"][k]["fwd_bwd_vs_stage2"]) for k in ("offload", "dpu"))
        clipped = max(v["clipped_fraction"] for v in s["variants"].values())
        rows.append(
            [str(job["world"]), job["precision"], fmt_q(s["offload_vs_stage2_optimizer"])]
            + [fmt_q(s["dpu"]["vs_offload"]), fmt_q(s["dpu"]["saved_of_cpu_step"], pct=True), ", ".join(fb)]
            + [f"{100 * clipped:.0f}%"]
        )
    out += [benchlib.md_table(header, rows), "\n", benchlib.measured_line(data, "bench_offload")]
    return "".join(out)
