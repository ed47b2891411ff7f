"""bench_deepspeed.py's results: per pair, the per-round ratios zoff / DeepSpeed with their quartiles, the
losses and whether they agree, the regime each side ran in (its norms against the clip, what zoff's speculation
committed), and the markdown table the docs embed (pure functions of the runs and the JSON)."""

from __future__ import annotations

import statistics

import benchlib

from zoff.engine.precision import clip_factor

LOSS_ATOL, LOSS_RTOL = 1e-3, 1e-3  # ~3 digits: bf16 compute, the same math summed in other orders
PAIRS = {"offload": "cpu", "nvme": "nvme"}


def quartiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs)}


def steady(runs: list[dict], side: str, k: int, warmup: int) -> float:
    """The median step of `side`'s run in round k, its first `warmup` steps left out."""
    return statistics.median(
        next(r for r in runs if r["side"] == side and r["round"] == k)["step_s"][warmup:]
    )


def summarize(runs: list[dict], warmup: int) -> dict:
    """Per pair: the per-round ratios zoff / DeepSpeed and their quartiles, losses, checksums, peak RSS."""
    out = {}
    for pair, tier in PAIRS.items():
        mine = [r for r in runs if r["tier"] == tier]
        if not mine:
            continue
        rounds = sorted({r["round"] for r in mine})
        med = lambda side, k, mine=mine: steady(mine, side, k, warmup)  # noqa: E731
        ratios = [med("zoff", k) / med("deepspeed", k) for k in rounds]
        first = {side: next(r for r in mine if r["side"] == side) for side in ("zoff", "deepspeed")}
        diff = max(abs(a - b) for a, b in zip(first["zoff"]["losses"], first["deepspeed"]["losses"]))
        tol_ok = all(abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b)
                     for a, b in zip(first["zoff"]["losses"], first["deepspeed"]["losses"]))  # fmt: skip
        spread = {s: max(abs(a - b) for r in mine if r["side"] == s for a, b in zip(r["losses"], first[s]["losses"]))
                  for s in first}  # fmt: skip
        out[pair] = {
            "ratio": quartiles(ratios), "ratios": ratios,
            "step_s": {s: quartiles([med(s, k) for k in rounds]) for s in first},
            "losses": {s: first[s]["losses"] for s in first}, "max_abs_loss_diff": diff, "losses_agree": tol_ok,
            "loss_spread_across_rounds": spread,
            "init_checksum": {s: first[s]["init_checksum"] for s in first},
            "init_equal": len({first[s]["init_checksum"] for s in first}) == 1,
            "peak_rss_bytes": {s: max(r["peak_rss_bytes"] for r in mine if r["side"] == s) for s in first},
            "startup_s": {s: statistics.median(r["startup_s"] for r in mine if r["side"] == s) for s in first},
            "norms": {s: first[s].get("norms") for s in first}, "speculation": first["zoff"].get("speculation"),
        }  # fmt: skip
    return out


def render(data: dict) -> str:
    """The markdown table the docs embed (pure)."""
    c, m = data["config"], data["config"]["model"]
    names = {"offload": "`zero3-offload` / ZeRO-3 offload to cpu", "nvme": "`zero3-nvme` / ZeRO-3 offload to nvme"}  # fmt: skip
    rows = []
    for pair, s in data["summary"].items():
        r, gib = s["ratio"], lambda b: f"{b / 2**30:.1f}"  # noqa: E731
        rows.append([names[pair], f"{s['step_s']['zoff']['median']:.2f}", f"{s['step_s']['deepspeed']['median']:.2f}",
                     f"**{r['median']:.2f}x** ({r['q1']:.2f}-{r['q3']:.2f})",
                     f"{s['max_abs_loss_diff']:.4f}" + ("" if s["losses_agree"] else " (DIFFER)"),
                     f"{gib(s['peak_rss_bytes']['zoff'])} / {gib(s['peak_rss_bytes']['deepspeed'])}"])  # fmt: skip
    head = (f"zoff's builtin GPT, {m['layers']} layers x {m['d_model']} ({data['params'] / 1e6:.0f}M parameters), "
            f"{m['batch']} x {m['seq_len']} tokens a step, {c['precision']}, 1 rank, {c['threads']} threads each; "
            f"deepspeed {data['deepspeed']} (CPU accelerator, gloo), torch {data['torch']}; {c['rounds']} rounds "
            f"in alternating order, {c['steps']} steps a run, the first {c['warmup']} not timed. Same init "
            f"(checksums equal: {all(s['init_equal'] for s in data['summary'].values())}), same batches; losses "
            f"agree within {LOSS_ATOL} + {LOSS_RTOL} x loss.\n\n")  # fmt: skip
    head += "".join(clip_line(names[pair], s, c["grad_clip"]) for pair, s in data["summary"].items())
    header = ["pair (zoff / DeepSpeed)", "zoff step, s", "DeepSpeed step, s", "zoff / DeepSpeed, median (q1-q3)",
              "max loss diff", "peak RSS GiB, zoff / DeepSpeed"]  # fmt: skip
    return head + benchlib.md_table(header, rows) + "\n" + benchlib.measured_line(data, "bench_deepspeed")


def clip_line(pair: str, s: dict, clip: float) -> str:
    """The regime a pair ran in: each side's norms against the clip, and what zoff's speculation committed
    (a JSON measured before norms were recorded: nothing)."""
    norms = s.get("norms") or {}
    if not all(norms.get(side) for side in ("zoff", "deepspeed")):
        return ""
    side = {k: f"norms {min(v):.3g}-{max(v):.3g}, clipped at {sum(clip_factor(n, clip) < 1.0 for n in v)} of"
               f" {len(v)} steps" for k, v in norms.items()}  # fmt: skip
    spec = s.get("speculation")
    committed = (f"; zoff's speculation committed {spec['committed_units']} of {spec['speculated_units']} units"
                 " speculated" if spec else "; zoff speculated nothing")  # fmt: skip
    return f"{pair}, train.grad_clip {clip:g}: zoff's {side['zoff']}, DeepSpeed's {side['deepspeed']}{committed}.\n\n"
