"""The README's results table: one row per benchmark, zoff's figure beside its peer's, with the date, commit and
machine of the measurement, every number read from the JSON the benchmark wrote under docs/results/.

    python scripts/headline.py    # print the table (scripts/render_docs.py embeds it in README.md)

Not a benchmark: it measures nothing. A row's figures change only when its benchmark is run again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
NAMES = (
    "bench_beyond_memory",
    "bench_engine",
    "bench_adam",
    "bench_offload",
    "bench_checkpoint",
    "bench_nvme",
    "bench_deepspeed",
    "bench_sequence_parallel",
)
PAGE = "docs/benchmarks.md"
GIB = 2**30


def load() -> dict:
    return {name: json.loads((RESULTS / f"{name}.json").read_text()) for name in NAMES}


def _machine(m: dict) -> str:
    if m.get("cpu", "unknown") == "unknown":
        return "unrecorded"
    ram = m.get("ram_bytes")
    return f"{m['cpu']}, {m['cores']} cores" + (f", {ram / GIB:.0f} GiB" if isinstance(ram, int) else "")


def _target(data: dict, name: str) -> float:
    return next(t["value"] for t in data["targets"] if t["target"].strip() == name)


def _adam(data: dict, n: int) -> dict:
    return next(r for r in data["results"] if r["n"] == n and r["threads"] == 2)["speedups"]


def _rss(ds: dict, pair: str) -> str:
    rss = ds["summary"][pair]["peak_rss_bytes"]
    return f"{rss['zoff'] / rss['deepspeed']:.2f}x"


def _offload_figures(off: dict) -> str:
    """zoff's CPU Adam against torch's, and the least DPU hides, over bench_offload's jobs."""
    cpu_vs_torch = [j["summary"]["offload_vs_stage2_optimizer"]["median"] for j in off["jobs"]]
    hidden = [j["summary"]["dpu"]["hidden_fraction"]["median"] for j in off["jobs"]]
    return (
        f"zoff's CPU Adam {min(cpu_vs_torch):.2f}-{max(cpu_vs_torch):.2f}x the time of torch's; DPU hides "
        f"**{min(hidden):.0%}** of the CPU step"
    )


def _sequence_parallel_figures(sp: dict) -> str:
    """N = 2 and 4 against N = 1: tokens/s, the all-to-all's share of the step, a rank's peak RSS."""
    cells = sp["cells"]
    rss = [cells[n]["peak_rss_mib"] / cells["1"]["peak_rss_mib"] for n in ("2", "4")]
    return (
        f"**{sp['speedup']['2']:.2f}x** / **{sp['speedup']['4']:.2f}x** N = 1's tokens/s on the same 2 cores; "
        f"all-to-all {100 * cells['2']['exchange_share']:.1f}% / {100 * cells['4']['exchange_share']:.1f}% "
        f"of the step; peak RSS a rank {rss[0]:.2f}x / {rss[1]:.2f}x; losses equal"
    )


def _rows(d: dict) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, zoff, peer beside it, where it lives in the page, JSON name)."""
    bm, eng, adam, off, ck, nv, ds, sp = (d[n] for n in NAMES)
    a16, a64 = _adam(adam, 16 << 20), _adam(adam, 64 << 20)
    return [
        (
            f"{bm['params'] / 1e9:.1f}B GPT, {bm['nproc']} rank, `zero3-nvme`, on a {bm['machine']['ram_bytes'] / GIB:.1f} GiB "
            "machine",
            f"model states {bm['model_state_to_ram']:.2f}x RAM; step {bm['step_time_median_s']:.1f} s, "
            f"**{bm['floor']['step_to_floor']:.2f}x** its floor; whole job's peak RSS "
            f"**{bm['peak_rss_job_bytes'] / GIB:.1f} GiB**",
            f"the floor, measured in the same job: max(compute + CPU Adam of the same layers with every state in "
            f"RAM, scaled: {bm['floor']['compute_adam_s']:.0f} s; the step's disk bytes at the disk's best "
            f"bandwidth: {bm['floor']['disk_s']:.0f} s)",
            "beyond-memory-a-34b-model-on-a-24-gib-machine",
            "bench_beyond_memory",
        ),
        (
            "ZeRO-2 / ZeRO-3 step time, 57M GPT, 2 ranks",
            f"stage 2 **{_target(eng, 'zoff2 step time / DDP'):.2f}x** DDP's time; stage 3 "
            f"**{_target(eng, 'zoff3 step time / FSDP2'):.2f}x** FSDP2's",
            "torch DDP, FSDP2 `fully_shard`, both with fused AdamW",
            "zero-stages-against-ddp-and-fsdp2",
            "bench_engine",
        ),
        (
            "fused CPU Adam, one flat fp32 tensor, 2 threads",
            f"**{a16['zoff CPUAdam vs torch fused (flat)']:.2f}x** (16M) and "
            f"**{a64['zoff CPUAdam vs torch fused (flat)']:.2f}x** (64M) torch fused's speed",
            "`torch.optim.AdamW(fused=True)`; the CPU default (for-loop) is "
            f"{min(a16['zoff CPUAdam vs torch default (model)'], a64['zoff CPUAdam vs torch default (model)']):.1f}x "
            "slower or more",
            "fused-cpu-adam",
            "bench_adam",
        ),
        (
            "offload step, 85M GPT, stage 2, 1-2 ranks",
            _offload_figures(off),
            "torch fused AdamW on the same shards (stage 2 without offload)",
            "offload-step",
            "bench_offload",
        ),
        (
            f"ZeRO-3 offload step, {ds['params'] / 1e6:.0f}M GPT ({ds['config']['model']['layers']} x "
            f"{ds['config']['model']['d_model']}), 1 rank, {ds['config']['precision']}, clip "
            f"{ds['config']['grad_clip']:g}",
            f"CPU offload **{ds['summary']['offload']['ratio']['median']:.2f}x** DeepSpeed's step time, disk tier "
            f"**{ds['summary']['nvme']['ratio']['median']:.2f}x**; peak RSS "
            f"{_rss(ds, 'offload')} and {_rss(ds, 'nvme')} of DeepSpeed's",
            f"DeepSpeed {ds['deepspeed']} ZeRO-3 with CPU / NVMe offload, same model, init and batches, run "
            "alternately in the same job (losses agree)",
            "against-deepspeed-zero-3-offload",
            "bench_deepspeed",
        ),
        (
            "sharded checkpoint, 1 GB of state, 2 ranks",
            f"save **{_target(ck, 'zoff save time / DCP save time'):.2f}x** DCP's time; `zoff convert` peak RSS "
            f"**{_target(ck, 'zoff convert peak RSS growth / naive' + chr(39) + 's'):.2f}x** a naive merge's",
            "`torch.distributed.checkpoint`; load-all-shards-then-save",
            "checkpoints",
            "bench_checkpoint",
        ),
        (
            f"one sequence of {sp['model']['seq']:,} tokens over N = 2 and 4 ranks (`train.sequence_parallel`)",
            _sequence_parallel_figures(sp),
            "the same sequence on one rank (N = 1), interleaved in the same run",
            "one-sequence-over-n-ranks",
            "bench_sequence_parallel",
        ),
        (
            "disk tier swap, /var/tmp",
            f"**{nv['swap_to_raw']['write']:.2f}x** / **{nv['swap_to_raw']['read']:.2f}x** the raw bandwidth "
            f"(write / read); NVMe optimizer step {nv['step_ratio']:.2f}x bytes / bandwidth",
            "raw `O_DIRECT` and `dd` on the same path, same run",
            "the-disk-tier-against-the-disk",
            "bench_nvme",
        ),
    ]


def render(data: dict) -> str:
    lines = [
        "| benchmark | zoff | the peer beside it | measured |",
        "|---|---|---|---|",
    ]
    for what, zoff, peer, anchor, name in _rows(data):
        d = data[name]
        when = f"{str(d['date'])[:10]}, `{d['commit']}`, {_machine(d['machine'])}"
        lines.append(f"| [{what}]({PAGE}#{anchor}) | {zoff} | {peer} | {when} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(load()))
