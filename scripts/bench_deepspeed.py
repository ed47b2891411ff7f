#!/usr/bin/env python
"""zoff's ZeRO-3 offload step beside DeepSpeed's, on the same model, init, batches and optimizer (opt-in).

Not a test, and not in the test suite: it needs its own venv with DeepSpeed (GBs, minutes to install). It
measures two pairs, one rank each, every run in its own process:
  offload: zoff `zero3-offload` against DeepSpeed ZeRO-3 with offload_optimizer and offload_param on cpu;
  nvme:    zoff `zero3-nvme` (host_budget min: every state on disk) against DeepSpeed ZeRO-3 with both
           offloaded to nvme (swap files under --path), its async-I/O op on libaio.
Both sides build zoff's builtin GPT (the layer shape of configs/gpt-3b-nvme.yaml, fewer layers) from the same
seed with zoff's init (a checksum of the initial parameters, gathered from each engine, must match), read the
same batches from zoff's data stream (data.name synthetic), train with AdamW (decay on matrices and
embeddings only, as zoff does), the same clip, LR and precision, and the same torch thread count
(torch.set_num_threads and OMP_NUM_THREADS = --threads on both). Rounds alternate the order (zoff first,
then DeepSpeed first, ...). Each run reports its step times (the first --warmup discarded), its losses and
its peak RSS (VmHWM; the checksum's gathered copy left out). Reported: per pair the median over rounds of zoff's median step / DeepSpeed's of
the same round (with q1-q3), the losses and their largest difference, which must stay within LOSS_ATOL +
LOSS_RTOL x |loss| (else the run fails: a peer that trains a different model is no peer).

    python scripts/bench_deepspeed.py --setup [--install-system-deps]  # the venv (once; idempotent)
    python scripts/bench_deepspeed.py                       # measure; writes docs/results/bench_deepspeed.json
    python scripts/bench_deepspeed.py --layers 2 --d-model 256 --steps 2 --rounds 1 --out /tmp/ds.json  # smoke
    python scripts/bench_deepspeed.py --render              # the markdown table from the JSON
    python scripts/bench_deepspeed.py --preset unclipped --precision fp32   # issue 53's regime a, on an AVX2 host

Two regimes (issue 53), each its own JSON and docs region: the default clips at --grad-clip 1.0, which this
model from initialisation exceeds at every step (regime b); --preset unclipped puts both sides' clip above
every norm (1e9), as in a warmed-up run that does not clip (regime a), where zoff's speculation (its recipes'
`auto`) may commit updates computed beside backward. Each table says each side's norms against the clip and
what zoff's speculation committed (deepspeed_report.py).

Costs: --setup makes /var/tmp/zoff-deepspeed-venv (1.3 GB: torch, the same version as this venv's, CPU build;
deepspeed 0.19.8; ninja; zoff editable) in ~3 minutes, then builds DeepSpeed's CPU Adam, pin-memory and
async-I/O ops with gcc (~9 minutes on 2 cores, once; kept in the venv folder). NVMe needs the Debian package
libaio-dev (--setup prints the apt-get line, or runs it with --install-system-deps). The default run (4
layers of 3072: 454M parameters; 3 rounds of 4 runs, 3 steps each) takes ~16 minutes on 2 cores, up to 12
GiB of RAM (DeepSpeed's cpu run) and ~8 GB of disk under --path while a nvme run lasts (removed after each).
Run logs: /var/tmp/zoff-deepspeed-logs.

On a CPU without fast bf16 kernels (no AVX512: a bf16 matmul ~100x fp32's time) a bf16 run takes hours, and
zoff's train.cpu_precision cannot switch DeepSpeed's side: the script refuses in one line (exit 2) and names
--precision fp32 (both sides) or --native-precision (bf16 anyway).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from deepspeed_report import LOSS_ATOL, LOSS_RTOL, PAIRS, render, summarize
from deepspeed_worker import RESULT, ds_config

# --preset: issue 53's two regimes, each its own JSON; the default clips at --grad-clip (1.0: this model clips
# from initialisation), unclipped puts the clip above every norm. A preset joins PRESETS, and with it the docs'
# region `render: bench_deepspeed --preset NAME` (tests/unit/test_docs.py), once its JSON is measured.
REGIMES = {
    "default": benchlib.Preset(benchlib.RESULTS / "bench_deepspeed.json"),
    "unclipped": benchlib.Preset(benchlib.RESULTS / "bench_deepspeed_unclipped.json"),
}
PRESETS = {k: v for k, v in REGIMES.items() if k == "default" or v.json.is_file()}
JSON = PRESETS["default"].json  # what the bare script writes
# --preset unclipped's clip on both sides: as in a warmed-up run whose norms stay under its clip
UNCLIPPED = 1e9
VENV = Path("/var/tmp/zoff-deepspeed-venv")  # a real disk: never tmpfs, never inside the repository
PY = VENV / "bin" / "python"
LOCK = Path("/var/tmp/zoff-deepspeed.lock")
DEEPSPEED = "0.19.8"
WORKER = Path(__file__).with_name("deepspeed_worker.py")  # one side's run, in its own process
APT = "apt-get update && apt-get install -y libaio-dev"


# ---------------------------------------------------------------------------------------------- setup
def ds_env(threads: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(VENV / "torch_extensions"),
               PIP_CONSTRAINT=str(VENV / "constraints.txt"), PIP_DISABLE_PIP_VERSION_CHECK="1")  # fmt: skip
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def stale_build_locks() -> list[Path]:
    """torch's extension-build locks in the venv. A worker killed while it builds or loads an op leaves its lock,
    and every later load waits on it forever (FileBaton.wait, no CPU, no message); while this script holds LOCK
    no other run of it can be using one."""
    return sorted((VENV / "torch_extensions").glob("*/lock"))


def has_libaio() -> bool:
    return Path("/usr/include/libaio.h").is_file()


def probe(env: dict) -> dict | None:
    """torch's and deepspeed's versions in the venv, or None where it has not both."""
    code = "import json, torch, deepspeed; print(json.dumps([torch.__version__, deepspeed.__version__]))"
    p = PY.is_file() and subprocess.run([str(PY), "-c", code], capture_output=True, text=True, env=env)
    return dict(zip(("torch", "deepspeed"), json.loads(p.stdout.splitlines()[-1]))) if p and p.returncode == 0 else None  # fmt: skip


def setup(install_system_deps: bool) -> int:
    """The venv: the project venv's torch (CPU build), deepspeed, ninja, zoff editable; then DeepSpeed's ops."""
    if not has_libaio():
        if not install_system_deps:
            print(f"bench_deepspeed: NVMe offload needs libaio-dev; as root run:\n  {APT}\n"
                  "(or pass --install-system-deps to run it)", file=sys.stderr)  # fmt: skip
            return 2
        subprocess.run(["bash", "-c", APT], check=True)
    import torch

    release = torch.__version__.split("+")[0]
    env = ds_env()
    VENV.mkdir(parents=True, exist_ok=True)
    # a constraint pins the torch so that deepspeed's requirements cannot swap it (and replaces any machine-wide one)
    (VENV / "constraints.txt").write_text(f"torch=={release}\n")
    have = probe(env)
    if have is None or have["torch"] != torch.__version__ or have["deepspeed"] != DEEPSPEED:
        if not PY.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(PY), "-m", "pip", "install", "--no-cache-dir"]
        build = "+cpu" if torch.version.cuda is None else ""
        if subprocess.run([*pip, f"torch=={release}{build}"], env=env).returncode != 0:
            subprocess.run([*pip, f"torch=={release}"], env=env, check=True)
        subprocess.run([*pip, f"deepspeed=={DEEPSPEED}", "ninja"], env=env, check=True)
    subprocess.run([str(PY), "-m", "pip", "install", "-q", "-e", str(benchlib.REPO)], env=env, check=True)  # fmt: skip
    print("building DeepSpeed's CPU Adam and async-I/O ops (once; kept in the venv folder) ...", flush=True)
    build = ("from deepspeed.accelerator import get_accelerator as g\n"
             "for op in ('CPUAdamBuilder', 'AsyncIOBuilder'):\n    g().create_op_builder(op).load()\n")  # fmt: skip
    subprocess.run([str(PY), "-c", build], env=env, check=True)
    print(f"ready: {VENV} ({probe(env)})")
    return 0


# ---------------------------------------------------------------------------------------- the parent
def run_side(spec: dict, log_dir: Path) -> dict:
    """One side in its own process (zoff's in this interpreter, DeepSpeed's in its venv); its result."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec = {**spec, "port": s.getsockname()[1]}
    swap = Path(spec["swap"])
    swap.mkdir(parents=True, exist_ok=True)
    py = sys.executable if spec["side"] == "zoff" else str(PY)
    env = ds_env(spec["threads"]) if spec["side"] == "deepspeed" else {
        **os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])}  # fmt: skip
    log = log_dir / f"{spec['side']}-{spec['tier']}-r{spec['round']}.log"
    t0 = time.perf_counter()
    try:
        with log.open("w") as f:
            p = subprocess.run([py, str(WORKER), json.dumps(spec)], stdout=f, stderr=subprocess.STDOUT,
                               env=env, cwd=benchlib.REPO)  # fmt: skip
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    out = log.read_text(errors="replace")
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        sys.exit(f"bench_deepspeed: {spec['side']} ({spec['tier']}) failed, exit {p.returncode}; {log}:\n"
                 + "\n".join(out.splitlines()[-30:]))  # fmt: skip
    return {**json.loads(lines[-1][len(RESULT) :]), "wall_s": time.perf_counter() - t0}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help="make or update the DeepSpeed venv; measure nothing")
    ap.add_argument("--install-system-deps", action="store_true", help="--setup: apt-get install libaio-dev")
    ap.add_argument("--render", action="store_true", help="print the markdown table from --out's JSON")
    ap.add_argument(
        "--preset", choices=list(REGIMES), default="default", help="the regime: its clip, its JSON"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=3072, help="64-wide heads, as gpt-3b-nvme.yaml")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps a run (the first --warmup are not timed)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", default="offload,nvme", help="offload, nvme or both")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch/OpenMP threads, both sides")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    benchlib.native_precision_arg(ap)
    ap.add_argument("--lr", type=float, default=3e-5, help="AdamW's (constant) LR, both sides")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="both sides' (--preset unclipped: 1e9)")
    ap.add_argument("--path", type=Path, default=Path("/var/tmp/zoff-deepspeed-swap"), help="nvme swap folder")  # fmt: skip
    ap.add_argument("--out", type=Path, help="default: the preset's JSON under docs/results/")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    a.out = a.out or REGIMES[a.preset].json
    if a.render:
        return benchlib.print_rendered(a.out, render)
    # before the lock: a refusal holds nothing; --setup computes nothing. Both sides compute on the CPU.
    cpu = None if a.setup else benchlib.cpu_precision_plan(
        "bench_deepspeed", a.precision, a.native_precision, on_cpu=True,
        refuse="pass --precision fp32 (both sides; DeepSpeed has no train.cpu_precision)",
    )  # fmt: skip
    lock = LOCK.open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"bench_deepspeed: another run holds {LOCK}: one at a time")
    if stale := stale_build_locks():
        sys.exit(f"bench_deepspeed: {stale[0]} was left by a DeepSpeed run killed while it built or loaded that "
                 "op (this run holds the bench's lock, so none is using it); DeepSpeed would wait on it forever: "
                 "remove it")  # fmt: skip
    if a.setup:
        return setup(a.install_system_deps)
    pairs = [p.strip() for p in a.pairs.split(",") if p.strip()]
    versions = probe(ds_env())
    if versions is None:
        sys.exit(
            f"bench_deepspeed: no DeepSpeed venv at {VENV}: run `python scripts/bench_deepspeed.py --setup`"
        )
    if "nvme" in pairs and not has_libaio():
        sys.exit(f"bench_deepspeed: the nvme pair needs libaio-dev: {APT}")
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    spec = {"model": {"layers": a.layers, "d_model": a.d_model, "seq_len": a.seq_len, "batch": a.batch},
            "optim": {"lr": a.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
            "schedule": {"warmup_steps": 0, "decay": "constant"}, "precision": a.precision,
            "grad_clip": UNCLIPPED if a.preset == "unclipped" else a.grad_clip,
            "seed": 0, "steps": a.steps, "threads": a.threads}  # fmt: skip
    log_dir = Path("/var/tmp/zoff-deepspeed-logs")
    log_dir.mkdir(exist_ok=True)
    prov, runs = benchlib.provenance(), []
    for k in range(a.rounds):
        for pair in pairs:
            for side in ("zoff", "deepspeed") if k % 2 == 0 else ("deepspeed", "zoff"):
                swap = a.path / f"{side}-{os.getpid()}"
                r = run_side(
                    {**spec, "side": side, "tier": PAIRS[pair], "round": k, "swap": str(swap)}, log_dir
                )
                runs.append({**r, "round": k})
                print(f"round {k + 1} {pair} {side}: steps {[round(t, 2) for t in r['step_s']]} s, losses "
                      f"{[round(x, 4) for x in r['losses']]}, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
                      f"init {r['init_checksum']}", flush=True)  # fmt: skip
    result = {**prov, "command": benchlib.command_line(ap, a, "bench_deepspeed"), "torch": versions["torch"],
              "deepspeed": versions["deepspeed"], "params": runs[0]["params"],
              "config": {**spec, "rounds": a.rounds, "warmup": a.warmup, "pairs": pairs, "path": str(a.path),
                         "loss_tolerance": {"atol": LOSS_ATOL, "rtol": LOSS_RTOL},
                         "deepspeed_config": {t: ds_config({**spec, "tier": t}, a.path / "deepspeed")
                                              for t in (PAIRS[p] for p in pairs)}},
              "runs": runs, "summary": summarize(runs, a.warmup), "loadavg": os.getloadavg(),
              "cpu_precision": cpu.to_json() if cpu else None}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(render(result))
    print(f"wrote {a.out}")
    bad = [p for p, s in result["summary"].items() if not (s["losses_agree"] and s["init_equal"])]
    if bad:
        print(f"bench_deepspeed: FAILED: {', '.join(bad)}: the two sides did not train the same model "
              "(init checksums or losses differ; see the JSON)", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
