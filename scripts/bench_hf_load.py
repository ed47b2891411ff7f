#!/usr/bin/env python
"""Loading a sharded Hugging Face checkpoint straight into the disk tier: a rank's peak RSS while it loads,
against the checkpoint's bytes (issue 32, item 4: <= 0.4 x the checkpoint + 0.5 GiB above the import baseline).

Not a test. A Llama-shaped folder of random bf16 weights is written shard by shard (model.safetensors.index.json
and several model-0000k-of-0000n.safetensors, as save_pretrained lays them out) without ever holding the model:
the names and shapes come from the model built on the meta device. Then, in a fresh process with one rank
(gloo), zoff builds it under zero3-nvme with `host_budget: min` (every optimizer state, parameter shard and
gradient on disk): shard-only loading (models/hf_shards.py) reads each tensor's byte range into the unit being
materialised, which goes to the parameter swap file, and the optimizer's fp32 master and moments are made piece
by piece into its swap file. The process resets its peak-RSS mark after its imports (/proc/self/clear_refs) and
reports VmHWM growth over that baseline, and samples its heap (RssAnon) and file-backed (RssFile) parts.
A check that what was loaded is the file's: the sum of every parameter's values, read back from the swap
files, against the sum over the safetensors files.

    python scripts/bench_hf_load.py --path /var/tmp [--hidden 3072 --layers 12]   # ~1.6B parameters, 3.1 GB
    python scripts/bench_hf_load.py --render
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import benchlib  # noqa: E402

JSON = benchlib.RESULTS / "bench_hf_load.json"
GIB = 2**30


def write_folder(folder: Path, a: argparse.Namespace) -> dict:
    """A Llama folder of random bf16 weights in shards of about --shard-gb, written tensor by tensor."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(
        hidden_size=a.hidden, num_hidden_layers=a.layers, intermediate_size=a.intermediate,
        num_attention_heads=a.hidden // 128, num_key_value_heads=a.hidden // 128, vocab_size=a.vocab,
        max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    folder.mkdir(parents=True)
    config.save_pretrained(str(folder))
    limit = int(a.shard_gb * 1e9)
    groups: list[list[str]] = [[]]
    size = 0
    for k, shape in shapes.items():
        n = 2 * math.prod(shape)
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    g = torch.Generator().manual_seed(0)
    weight_map, total, checksum = {}, 0, 0.0
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.randn(shapes[k], generator=g) * 0.02).to(torch.bfloat16) for k in keys}
        checksum += sum(float(t.double().sum()) for t in tensors.values())
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(keys, name))
        total += (folder / name).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"params": sum(math.prod(s) for s in shapes.values()), "bytes": total, "files": len(groups),
            "checksum": checksum}  # fmt: skip


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out


def load(folder: Path, swap: Path) -> dict:
    """In this (fresh) process: build the folder into a zero3-nvme engine at host_budget min, measured."""
    import torch
    import torch.distributed as dist

    from zoff.config import config_from_dict
    from zoff.engine import build_engine
    from zoff.models import build_for_engine, builds_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = config_from_dict({
        "model": {"name": "hf:LlamaForCausalLM", "path": str(folder)},
        "zero": {"recipe": "zero3-nvme", "offload_optimizer": {"nvme_path": str(swap), "host_budget": "min"},
                 "offload_param": {"nvme_path": str(swap)}},
        "train": {"precision": "bf16"},
    })  # fmt: skip
    assert builds_sharded(cfg.model)  # imports transformers' model code before the baseline
    Path("/proc/self/clear_refs").write_text("5")
    base = _status()
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            s = _status()
            for k in peaks:
                peaks[k] = max(peaks[k], s[k])

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    engine = build_engine(build_for_engine(cfg.model), cfg.zero, cfg.optim, precision="bf16")
    seconds = time.perf_counter() - t0
    done.set()
    end = _status()
    mem = engine.memory_report()
    checksum = 0.0
    with torch.no_grad():  # what the disk tier holds, read back unit by unit
        for u in range(len(engine.plan.all_units)):
            checksum += float(engine.param_shard(u).double().sum())
    engine.close()
    dist.destroy_process_group()
    return {
        "seconds": seconds, "base_rss": base["VmRSS"], "peak_growth": end["VmHWM"] - base["VmRSS"],
        "peak_anon": peaks["RssAnon"], "peak_file": peaks["RssFile"], "end_growth": end["VmRSS"] - base["VmRSS"],
        "disk_bytes": {k: v for k, v in mem.items() if k.startswith("disk_")}, "loaded_checksum": checksum,
    }  # fmt: skip


def targets(data: dict) -> list[dict]:
    limit = 0.4 * data["folder"]["bytes"] + 0.5 * GIB
    grew = data["load"]["peak_growth"]
    return [{"target": "peak RSS growth while loading, GiB", "value": grew / GIB, "limit": limit / GIB,
             "result": "PASS" if grew <= limit else "MISS"}]  # fmt: skip


def render(data: dict) -> str:
    f, ld = data["folder"], data["load"]
    rows = [
        ["checkpoint", f"{f['params'] / 1e9:.2f}B parameters, bf16, {f['files']} files, {f['bytes'] / 1e9:.2f} GB"],
        ["load into zero3-nvme (host_budget min), one rank", f"{ld['seconds']:.1f} s"],
        ["peak RSS growth over the import baseline", f"{ld['peak_growth'] / GIB:.2f} GiB "
         f"({ld['peak_growth'] / f['bytes']:.2f}x the checkpoint; heap {ld['peak_anon'] / GIB:.2f} GiB, "
         f"file-backed {ld['peak_file'] / GIB:.2f} GiB at their sampled peaks, baseline {ld['base_rss'] / GIB:.2f} GiB)"],
        ["on disk after loading", ", ".join(f"{k[5:]} {v / GIB:.1f} GiB" for k, v in ld["disk_bytes"].items())],
        ["sum of the loaded weights / the files'", f"{ld['loaded_checksum']:.6g} / {f['checksum']:.6g}"],
    ]  # fmt: skip
    return "".join([
        benchlib.md_table(["", ""], rows), "\n", benchlib.md_targets(targets(data)), "\n",
        benchlib.measured_line(data, "bench_hf_load"),
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--path", type=Path, help="a folder on a local disk for the checkpoint and the swap files"
    )
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=JSON)
    ap.add_argument("--render", action="store_true", help="only print the markdown from --out's JSON")
    ap.add_argument(
        "--load", nargs=2, type=Path, help=argparse.SUPPRESS
    )  # internal: FOLDER SWAP, fresh process
    a = ap.parse_args()
    if a.load:
        print(json.dumps(load(*a.load)))
        return
    if a.render:
        sys.exit(benchlib.print_rendered(a.out, render))
    if a.path is None:
        ap.error("--path is required to measure")
    work = a.path / f"zoff-bench-hf-load-{os.getpid()}"
    try:
        folder = write_folder(work / "model", a)
        (work / "swap").mkdir()
        p = subprocess.run(
            [sys.executable, __file__, "--load", str(work / "model"), str(work / "swap")],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())},
        )  # fmt: skip
        if p.returncode != 0:
            sys.exit(f"the load failed:\n{p.stderr[-3000:]}")
        loaded = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = {**benchlib.provenance(), "command": benchlib.command_line(ap, a, "bench_hf_load"),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "folder": folder, "load": loaded}  # fmt: skip
    a.out.write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(render(data))


if __name__ == "__main__":
    main()
