"""The reporting side of scripts/bench_checkpoint.py: a convert run's fields from what its subprocess reported,
the rounds' medians and per-round ratios, the targets, the rich tables it prints and the markdown tables the
docs embed (render, a pure function of the JSON)."""

from __future__ import annotations

import statistics

import benchlib
from benchlib import print_targets
from rich.console import Console
from rich.table import Table

WORLD = 2
VARIANTS = ("zoff", "torch.save", "dcp")
GB = 1e9
MiB = 2**20
SAVE_TARGET = 1.2  # zoff save time <= 1.2 x DCP's
RSS_TARGET = 0.25  # zoff convert peak RSS growth <= 1/4 of the naive export's


def convert_result(r: dict, wall: float, out_bytes: int) -> dict:
    """A convert run's JSON fields from what its subprocess reported (`r`): its time, and its peak RSS growth
    over the post-import RSS (exact, VmHWM) with the sampled heap and file-backed parts."""
    base, after, peak = r["base"], r["after"], r["sampled_peak"]
    return {
        "elapsed_s": r["elapsed_s"],
        "process_wall_s": wall,
        "output_bytes": out_bytes,
        "gb_per_s": out_bytes / r["elapsed_s"] / GB,
        "peak_rss_bytes": after["VmHWM"],
        "peak_rss_growth_bytes": after["VmHWM"] - base["VmRSS"],
        "sampled_heap_growth_bytes": peak["RssAnon"] - base["RssAnon"],
        "sampled_file_backed_growth_bytes": peak["RssFile"] - base["RssFile"],
        "hwm_reset": r["hwm_reset"],
    }


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(rounds: list[dict]) -> dict:
    out: dict = {"variants": {}, "ratios": {}}
    for kind in VARIANTS:
        v = {"bytes": statistics.median(r[kind]["bytes"] for r in rounds)}
        for op in ("save", "load"):
            secs = [r[kind][f"{op}_s"] for r in rounds]
            v[f"{op}_s"] = statistics.median(secs)
            v[f"{op}_gb_per_s"] = statistics.median(
                r[kind]["bytes"] / r[kind][f"{op}_s"] / GB for r in rounds
            )
        out["variants"][kind] = v
    z = out["variants"]["zoff"]
    z["load_noverify_s"] = statistics.median(r["zoff"]["load_noverify_s"] for r in rounds)
    z["load_noverify_gb_per_s"] = statistics.median(
        r["zoff"]["bytes"] / r["zoff"]["load_noverify_s"] / GB for r in rounds
    )
    for op, zkey in (("save", "save_s"), ("load", "load_s"), ("load", "load_noverify_s")):
        for base in ("dcp", "torch.save"):
            xs = [r["zoff"][zkey] / r[base][f"{op}_s"] for r in rounds]
            name = f"zoff/{base} {op}" + (" (zoff without verify)" if "noverify" in zkey else "")
            out["ratios"][name] = {"median": statistics.median(xs), "q1_q3": quartiles(xs), "per_round": xs}
    return out


def targets(summary: dict, conv: dict) -> list[dict]:
    save = summary["ratios"]["zoff/dcp save"]["median"]
    rss = conv["zoff"]["peak_rss_growth_bytes"] / conv["naive"]["peak_rss_growth_bytes"]
    heap = conv["zoff"]["sampled_heap_growth_bytes"] / conv["naive"]["sampled_heap_growth_bytes"]
    return [
        {"target": "zoff save time / DCP save time", "value": save, "limit": SAVE_TARGET,
         "result": "PASS" if save <= SAVE_TARGET else "MISS"},
        {"target": "zoff convert peak RSS growth / naive's", "value": rss, "limit": RSS_TARGET,
         "result": "PASS" if rss <= RSS_TARGET else "MISS"},
        {"target": "  (info) heap-only (RssAnon) growth / naive's", "value": heap, "limit": RSS_TARGET,
         "result": "info"},
    ]  # fmt: skip


def print_tables(result: dict) -> None:
    con = Console(width=max(120, Console().width))
    m, s, c = result["machine"], result["summary"], result["convert"]
    con.print(
        f"[bold]{result['params'] / 1e6:.1f}M-param GPT (fp32), {WORLD} ranks gloo, {result['args']['rounds']} "
        f"rounds[/bold]; {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB; tmp on {m['tmp_dir_fs']}; "
        f"torch {m['torch']}; load avg {' '.join(m['loadavg_start'])} -> {' '.join(m['loadavg_end'])}"
    )
    tab = Table(title="save / load (medians over rounds; loads are page-cache-hot)")
    for col in ("variant", "bytes", "save s", "save GB/s", "load s", "load GB/s"):
        tab.add_column(col, justify="right" if col != "variant" else "left")
    for kind, v in s["variants"].items():
        tab.add_row(
            kind, f"{v['bytes'] / GB:.2f} GB", f"{v['save_s']:.2f}", f"{v['save_gb_per_s']:.2f}",
            f"{v['load_s']:.2f}", f"{v['load_gb_per_s']:.2f}",
        )  # fmt: skip
    z = s["variants"]["zoff"]
    tab.add_row(
        "zoff load w/o verify",
        "",
        "",
        "",
        f"{z['load_noverify_s']:.2f}",
        f"{z['load_noverify_gb_per_s']:.2f}",
    )
    con.print(tab)
    tab = Table(title="per-round time ratios (median, quartiles)")
    tab.add_column("ratio")
    tab.add_column("median", justify="right")
    tab.add_column("q1-q3", justify="right")
    for k, v in s["ratios"].items():
        tab.add_row(k, f"{v['median']:.2f}", f"{v['q1_q3'][0]:.2f}-{v['q1_q3'][1]:.2f}")
    con.print(tab)
    tab = Table(title="convert (fresh subprocess each; growth over the post-import RSS)")
    for col in ("exporter", "time s", "GB/s", "peak RSS", "peak growth", "heap growth*", "file-backed*"):
        tab.add_column(col, justify="right" if col != "exporter" else "left")
    for k, v in c.items():
        tab.add_row(
            k, f"{v['elapsed_s']:.2f}", f"{v['gb_per_s']:.2f}", f"{v['peak_rss_bytes'] / MiB:.0f} MiB",
            f"{v['peak_rss_growth_bytes'] / MiB:.0f} MiB", f"{v['sampled_heap_growth_bytes'] / MiB:.0f} MiB",
            f"{v['sampled_file_backed_growth_bytes'] / MiB:.0f} MiB",
        )  # fmt: skip
    con.print(tab)
    con.print("  * sampled every 2 ms (RssAnon / RssFile); peak growth is the kernel's exact VmHWM")
    print_targets(con, "targets (issue 5)", result["targets"])


LABEL = {
    "zoff": "zoff",
    "torch.save": "torch.save (rank 0, full state)",
    "dcp": "torch.distributed.checkpoint",
}


def render(data: dict) -> str:
    """The markdown tables the docs embed: save and load per variant with zoff's per-round ratios, the export
    against the naive one, the targets; pure."""
    s, c, a = data["summary"], data["convert"], data["args"]
    v, r = s["variants"], s["ratios"]
    ratio = lambda key: "{:.2f}x ({:.2f}-{:.2f})".format(r[key]["median"], *r[key]["q1_q3"])  # noqa: E731
    out = [
        f"{data['params'] / 1e6:.1f}M-parameter GPT ({a['layers']} layers x {a['d_model']}), fp32, {WORLD} ranks, "
        f"{v['zoff']['bytes'] / GB:.2f} GB per checkpoint (master + Adam moments), {a['rounds']} interleaved "
        f"rounds, scratch on {data['machine']['tmp_dir_fs']}; medians of rounds, ratios as median (q1-q3) of "
        "per-round ratios; loads follow saves, page-cache-hot.\n\n"
    ]
    rows = [
        ["save s", *(f"{v[k]['save_s']:.2f}" for k in VARIANTS)],
        ["save GB/s", *(f"{v[k]['save_gb_per_s']:.2f}" for k in VARIANTS)],
        ["zoff / peer, save", "", ratio("zoff/torch.save save"), ratio("zoff/dcp save")],
        ["load s", *(f"{v[k]['load_s']:.2f}" for k in VARIANTS)],
        ["load s, zoff without checksum verify", f"{v['zoff']['load_noverify_s']:.2f}", "", ""],
        ["zoff / peer, load", "", ratio("zoff/torch.save load"), ratio("zoff/dcp load")],
    ]
    out += [benchlib.md_table(["", *(LABEL[k] for k in VARIANTS)], rows), "\n"]
    names = {"zoff": "`zoff convert` (streams tensor by tensor, verifies every checksum)",
             "naive": "naive: load all shards, merge, save"}  # fmt: skip
    rows = [
        [
            names[k],
            f"{x['elapsed_s']:.1f} s",
            f"{x['gb_per_s']:.2f}",
            f"{x['peak_rss_growth_bytes'] / MiB:.0f} MiB",
        ]
        + [f"{x['sampled_heap_growth_bytes'] / MiB:.0f} MiB"]
        for k, x in c.items()
    ]
    header = ["export", "time", "GB/s", "peak RSS growth (VmHWM)", "heap growth (RssAnon, sampled)"]
    out += [
        benchlib.md_table(header, rows),
        "\n",
        benchlib.md_targets(data["targets"]),
        "\n",
        benchlib.measured_line(data, "bench_checkpoint"),
    ]
    return "".join(out)
