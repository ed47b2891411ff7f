#!/usr/bin/env python
"""The shipped fine-tuning recipes run as a user runs them: configs/llama-sft.yaml (full fine-tuning, 2 ranks)
and configs/llama-lora.yaml (LoRA through peft, 1 rank), their losses, times, peak RSS per rank and checkpoint
and adapter sizes, for docs/fine-tuning.md and the configs' `# Expected:` headers.

Not a test. `python scripts/make_finetune_data.py` first (it writes the tiny random Llama base, or says it is
there), then per round and recipe `python -m zoff train CONFIG --run-dir DIR` in a subprocess while /proc is
sampled (beyond_memory_probe.Sampler: each rank's VmHWM, the rank told by the log it holds open; summary.json's
peak_rss_mib and metrics.jsonl's are rank 0's only). The losses, steps, training time and tokens/s come from
the run's summary.json and metrics.jsonl; the wall time is the subprocess's, start-up and the final checkpoint
included. For LoRA, `python -m zoff convert RUN/checkpoints OUT --format peft` writes the adapter folder whose
bytes and tensor elements are recorded. Recipes run interleaved round by round; the table shows medians.

    python scripts/bench_finetune.py [--rounds 3]    # about 1-2 minutes per recipe and round on 2 idle cores
    python scripts/bench_finetune.py --render
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import benchlib  # noqa: E402
from beyond_memory_probe import Sampler  # noqa: E402

JSON = benchlib.RESULTS / "bench_finetune.json"
RECIPES = ("llama-sft", "llama-lora")  # configs/<name>.yaml, as shipped: no overrides
BASE = REPO / "examples" / "finetune" / "tiny-llama"
MIB = 2**20


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tensor_elements(path: Path) -> int:
    """Elements of every tensor in a safetensors file, read from its header (no tensor is loaded)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        total = 0
        for k in f.keys():
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            total += n
        return total


def latest_checkpoint(run_dir: Path) -> Path:
    ckpts = run_dir / "checkpoints"
    return ckpts / (ckpts / "latest").read_text().strip()


def run_recipe(name: str, run_dir: Path, interval: float) -> dict:
    """One `zoff train` of configs/<name>.yaml into run_dir, sampled; the figures the table shows."""
    from zoff.config import load_config

    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    cmd = [sys.executable, "-m", "zoff", "train", f"configs/{name}.yaml", "--run-dir", str(run_dir)]
    print("running: " + " ".join(cmd), flush=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
    sampler = Sampler(proc.pid, [], None, run_dir / "metrics.jsonl", cfg.train.max_steps)
    while proc.poll() is None:
        sampler.sample()
        time.sleep(interval)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{name}: zoff train exited {proc.returncode}; see {run_dir}/logs")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    # VmHWM is the kernel's high-water mark over the process's life, so the last sample before a rank exits
    # holds its peak, save for growth in its last `interval` seconds; summary.json's figure (rank 0's
    # ru_maxrss when the summary is written) is kept beside it as a check
    ranks = {
        p["role"]: p["vm_hwm_bytes"] / MIB for p in sampler.per_process() if p["role"].startswith("rank")
    }
    ckpt = latest_checkpoint(run_dir)
    out = {
        "ranks": cfg.launch.nproc_per_node,
        "steps": summary["steps"],
        "first_loss": summary["first_loss"],
        "final_loss": summary["final_loss"],
        "final_val_loss": summary["final_val_loss"],
        "val_losses": [[r["step"], r["val_loss"]] for r in records if "val_loss" in r],
        "wall_s": wall,
        "train_time_s": summary["train_time_s"],
        "tokens_per_s": summary["mean_tokens_per_s"],
        "peak_rss_mib": dict(sorted(ranks.items(), key=lambda kv: int(kv[0][4:]))),
        "rank0_summary_peak_rss_mib": summary["peak_rss_mib"],
        "checkpoint_bytes": folder_bytes(ckpt),
        "loadavg_1min": [load_before, os.getloadavg()[0]],  # other work on the host slows the timings
    }
    if cfg.model.lora.enabled:
        out["adapter"] = export_adapter(run_dir)
    return out


def export_adapter(run_dir: Path) -> dict:
    """`zoff convert RUN/checkpoints OUT --format peft`, as the docs tell a user; what it wrote."""
    folder = run_dir.with_name(run_dir.name + "-peft")
    ckpts = str(run_dir / "checkpoints")
    cmd = [sys.executable, "-m", "zoff", "convert", ckpts, str(folder), "--format", "peft"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return {
        "convert_s": time.perf_counter() - t0,
        "bytes": folder_bytes(folder),
        "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()},
        "params": tensor_elements(folder / "adapter_model.safetensors"),
    }


MEDIAN_KEYS = ("wall_s", "train_time_s", "tokens_per_s", "first_loss", "final_loss", "final_val_loss")


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds of what varies; the losses are seeded, so they should not (`losses_same` says)."""
    med = {k: statistics.median(r[k] for r in rounds) for k in MEDIAN_KEYS}
    med["peak_rss_mib"] = {
        k: statistics.median(r["peak_rss_mib"][k] for r in rounds) for k in rounds[0]["peak_rss_mib"]
    }
    med["losses_same"] = len({(r["first_loss"], r["final_loss"], r["final_val_loss"]) for r in rounds}) == 1
    return med


# --------------------------------------------------------------------------------------------- rendering
def _adapter(rec: dict) -> str:
    a = rec["rounds"][0].get("adapter")
    if a is None:
        return "-"
    return f"{a['params']:,} parameters, {a['bytes'] / 1e6:.2f} MB (`zoff convert --format peft`)"


def _spread(rounds: list[dict], key: str) -> str:
    """ " (min-max)" over rounds: how much the host's other work moved a timing."""
    vals = [r[key] for r in rounds]
    return f" ({min(vals):.0f}-{max(vals):.0f})" if len(vals) > 1 else ""


def render(data: dict) -> str:
    """One row per recipe (medians over rounds), a note on what each column is, and where it was measured."""
    rows = []
    for name, rec in data["recipes"].items():
        m, r0 = rec["median"], rec["rounds"][0]
        rss = " / ".join(f"{v:,.0f}" for v in m["peak_rss_mib"].values())
        rows.append([
            f"`configs/{name}.yaml`", str(r0["ranks"]), str(r0["steps"]),
            f"{m['first_loss']:.2f} -> {m['final_loss']:.2f} (val {m['final_val_loss']:.2f})",
            f"{m['wall_s']:.0f} s{_spread(rec['rounds'], 'wall_s')}, training {m['train_time_s']:.0f} s",
            f"{m['tokens_per_s']:,.0f}",
            f"{rss} MiB", f"{r0['checkpoint_bytes'] / 1e6:.1f} MB", _adapter(rec),
        ])  # fmt: skip
    header = ["recipe", "ranks", "steps", "loss first -> final (val)", "wall time (range)", "tok/s (all ranks)",
              "peak RSS per rank", "checkpoint", "adapter"]  # fmt: skip
    n = data["rounds"]
    load = [x for rec in data["recipes"].values() for r in rec["rounds"] for x in r["loadavg_1min"]]
    note = (
        f"{'Medians of ' + str(n) + ' rounds' if n > 1 else 'One round'}; wall time is `zoff train`'s whole run "
        f"(start-up, evaluation and the final checkpoint included), training time and tok/s are from its "
        f"summary.json, peak RSS is each rank's VmHWM; the base is a random Llama of {data['base_params']:,} "
        f"parameters; the host's 1-minute load average was "
        f"{min(load):.1f}-{max(load):.1f} during the runs (on {data['machine'].get('cores', '?')} cores: "
        f"other work slows the timings, not the losses).\n"
    )
    return "".join(
        [benchlib.md_table(header, rows), "\n", note, "\n", benchlib.measured_line(data, "bench_finetune")]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of each recipe, interleaved; the table shows medians"
    )
    ap.add_argument("--work", type=Path, help="where the run folders go (default runs/bench/finetune-<time>)")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between /proc samples")
    ap.add_argument("--keep", action="store_true", help="keep the run folders (default: removed after)")
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown from --out's JSON")
    a = ap.parse_args()
    if a.render:
        sys.exit(benchlib.print_rendered(a.out, render))
    # the recipes read the base and tokenizer this writes (chat.jsonl ships); a no-op when they are there
    subprocess.run([sys.executable, "scripts/make_finetune_data.py"], cwd=REPO, check=True)
    work = a.work or REPO / "runs" / "bench" / f"finetune-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True, exist_ok=True)
    data = {**benchlib.provenance(), "command": benchlib.command_line(ap, a, "bench_finetune"), "rounds": a.rounds,
            "base_params": tensor_elements(BASE / "model.safetensors"), "recipes": {}}  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in RECIPES}
    for i in range(a.rounds):  # interleaved, so that a busy spell on the host falls on both recipes
        for name in RECIPES:
            runs[name].append(run_recipe(name, work / f"{name}-{i}", a.interval))
    if not a.keep:  # a failed run exits above and leaves its folder (and logs) for reading
        shutil.rmtree(work, ignore_errors=True)
    data["recipes"] = {name: {"config": f"configs/{name}.yaml", "rounds": rs, "median": summarize(rs)}
                       for name, rs in runs.items()}  # fmt: skip
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(render(data))


if __name__ == "__main__":
    main()
