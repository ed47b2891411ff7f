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
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from deepspeed_report import LOSS_ATOL, LOSS_RTOL, PAIRS, render, summarize

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
APT = "apt-get update && apt-get install -y libaio-dev"
RESULT = "BENCH_DEEPSPEED_RESULT "


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


# --------------------------------------------------------------------------------------- the worker
def zoff_config(spec: dict, swap: Path):
    from zoff.config import config_from_dict

    zero: dict = {"recipe": "zero3-offload"}
    if spec["tier"] == "nvme":  # gpt-3b-nvme.yaml's disk tier, every state on disk as DeepSpeed's nvme has it
        zero = {"recipe": "zero3-nvme", "prefetch_bucket_size": 120_000_000,
                "offload_optimizer": {"nvme_path": str(swap), "host_budget": "min"},
                "offload_param": {"nvme_path": str(swap)}}  # fmt: skip
    m = spec["model"]
    return config_from_dict({
        "model": {"name": "gpt", "n_layer": m["layers"], "n_head": m["d_model"] // 64, "d_model": m["d_model"],
                  "vocab_size": 256, "seq_len": m["seq_len"]},
        "data": {"name": "synthetic", "seq_len": m["seq_len"], "batch_size": m["batch"]},
        "zero": zero, "optim": spec["optim"], "schedule": spec["schedule"],
        "train": {"max_steps": spec["steps"], "grad_clip": spec["grad_clip"], "precision": spec["precision"],
                  "seed": spec["seed"]},
        "checkpoint": {"enabled": False},
    })  # fmt: skip


def ds_config(spec: dict, swap: Path) -> dict:
    """DeepSpeed's ZeRO-3 with both offloads on spec's tier, its defaults elsewhere but sub_group_size 1e8 on
    nvme: its default 1e9 would hold this model's whole optimizer state in RAM at once. The aio section spells
    out its defaults (0.19.8 ignores thread_count; its intra_op_parallelism is 1 by default)."""
    o, tier = spec["optim"], spec["tier"]
    off = {"device": tier, "pin_memory": False, **({"nvme_path": str(swap)} if tier == "nvme" else {})}
    zero = {"stage": 3, "offload_optimizer": dict(off), "offload_param": dict(off)}
    cfg = {
        "train_micro_batch_size_per_gpu": spec["model"]["batch"], "gradient_accumulation_steps": 1,
        "gradient_clipping": spec["grad_clip"], "steps_per_print": 1 << 30, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": o["lr"], "betas": o["betas"], "eps": o["eps"],
                                                  "weight_decay": o["weight_decay"]}},
        "bf16": {"enabled": spec["precision"] == "bf16"},
    }  # fmt: skip
    if tier == "nvme":
        zero["sub_group_size"] = 100_000_000
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}  # fmt: skip
    return cfg


def checksum(named) -> tuple[str, int]:
    """sha256 over (name, tensor) pairs' fp32 bytes, taken one at a time (nothing kept); and their elements."""
    import hashlib

    import torch

    h, n = hashlib.sha256(), 0
    for name, t in named:
        h.update(name.encode() + t.detach().to(torch.float32).contiguous().numpy().tobytes())
        n += t.numel()
    return h.hexdigest()[:16], n


def peak_rss(reset: bool = False) -> int:
    """This process's peak RSS (VmHWM) so far; reset: start a new peak from the current RSS (Linux 4.0+)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(spec: dict) -> dict:
    """One run of one side: build, train spec["steps"] steps, report times, losses, checksum and peak RSS."""
    import torch
    import torch.distributed as dist

    from zoff.data import GlobalBatches, load_corpus
    from zoff.models import lm_loss
    from zoff.trainer.schedule import lr_at

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    torch.set_num_threads(spec["threads"])
    swap = Path(spec["swap"])
    cfg = zoff_config(spec, swap)
    t_start = time.perf_counter()
    norms: list[float] = []  # each step's global gradient norm, before the clip
    if spec["side"] == "zoff":
        from zoff.trainer.loss import forward_loss
        from zoff.trainer.session import build_session

        dist.init_process_group("gloo", rank=0, world_size=1)
        s = build_session(cfg, torch.device("cpu"))  # what `zoff train` builds on each rank
        engine, batches = s.engine, s.batches
        built_peak, startup = peak_rss(), time.perf_counter() - t_start
        full = (
            engine.gathered_params()
        )  # (fp32 masters, made from the bf16 shards as DeepSpeed makes its own)
        init, params = checksum((n, full[n]) for n in sorted(n for n, _ in engine.model.named_parameters()))
        del full

        def step(i: int, lr: float) -> float:  # train_loop's step
            engine.model.train()
            engine.zero_grad()
            loss = forward_loss(engine.model, batches.micro_batch_at(i, 0), 1, engine.device)
            # the step's lr, as train_loop hands it: speculation computes the update beside backward
            engine.backward(loss, sync=True, lr=lr)
            norms.append(engine.step(lr).grad_norm)
            return float(loss.detach())

        close = engine.close
    else:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from zoff.models import build_model

        deepspeed.init_distributed(dist_backend="gloo")
        dsc = ds_config(spec, swap)
        remote = spec["tier"] if spec["tier"] == "nvme" else "cpu"
        torch.manual_seed(cfg.train.seed)  # as build_session: the GPT draws its init seed from it
        # partitioned as built, then drawn with zoff's init one gathered parameter at a time (zoff's engine
        # materialises its shards with the same init_parameter). The dtype comes from the config's bf16
        # section: 0.19.8's zero.Init, handed a dtype, takes bf16 on the CPU accelerator whatever it was given
        # (`dtype or fp16 if fp16-capable else bf16 ...`: precedence), so an fp32 run computed in bf16.
        with deepspeed.zero.Init(config_dict_or_path=dsc, remote_device=remote):
            model = build_model(cfg.model)
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                model.init_parameter(name, p.data)
        decay = [p for p in model.parameters() if len(p.ds_shape) >= 2]
        rest = [p for p in model.parameters() if len(p.ds_shape) < 2]
        groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=dsc)
        torch.set_num_threads(spec["threads"])
        built_peak, startup = peak_rss(), time.perf_counter() - t_start
        named = dict(engine.module.named_parameters())

        def gathered():
            for name in sorted(named):
                with deepspeed.zero.GatheredParameters([named[name]]):
                    yield name, named[name].data

        init, params = checksum(gathered())
        batches = GlobalBatches(load_corpus(cfg.data, cfg.train.seed), cfg.data.seq_len, cfg.data.batch_size,
                                1, 0, 1, cfg.train.seed)  # fmt: skip
        torch.manual_seed(cfg.train.seed + 1)  # as build_session (dropout is 0 here anyway)
        spec["deepspeed_accelerator"] = get_accelerator().device_name()

        def step(i: int, lr: float) -> float:
            for g in engine.optimizer.param_groups:
                g["lr"] = lr
            x, y = batches.micro_batch_at(i, 0)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            norm = engine.get_global_grad_norm()  # (None where this DeepSpeed computed none)
            norms.append(float("nan") if norm is None else float(norm))
            return float(loss.detach())

        close = engine.destroy if hasattr(engine, "destroy") else (lambda: None)
    peak_rss(reset=True)  # the checksum's gathered copies are the benchmark's, not the run's: left out
    times, losses = [], []
    for i in range(spec["steps"]):
        t0 = time.perf_counter()
        losses.append(step(i, lr_at(i, cfg.optim.lr, cfg.train.max_steps, cfg.schedule)))
        times.append(time.perf_counter() - t0)
        print(f"{spec['side']} {spec['tier']} step {i + 1}: loss {losses[-1]:.4f} {times[-1]:.2f} s", flush=True)  # fmt: skip
    threads = torch.get_num_threads()
    # zoff's speculation (its recipes' speculate: auto), None where it never speculates
    zs = engine.speculation if spec["side"] == "zoff" else None
    speculation = dict(zs.counts) if zs is not None else None
    close()
    peak = max(built_peak, peak_rss())
    return {"side": spec["side"], "tier": spec["tier"], "step_s": times, "losses": losses, "init_checksum": init,
            "params": params, "peak_rss_bytes": peak, "startup_s": startup, "threads_at_end": threads,
            "norms": norms, "speculation": speculation,
            "torch": torch.__version__, "accelerator": spec.get("deepspeed_accelerator")}  # fmt: skip


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
            p = subprocess.run([py, __file__, "--worker", json.dumps(spec)], stdout=f, stderr=subprocess.STDOUT,
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
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    a.out = a.out or REGIMES[a.preset].json
    if a.worker:
        print(RESULT + json.dumps(worker(json.loads(a.worker))), flush=True)
        return 0
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
