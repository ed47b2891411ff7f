"""One run of one side of scripts/bench_deepspeed.py, in its own process: zoff's engine (this venv) or
DeepSpeed's (the DeepSpeed venv, which has zoff installed too), built on the same model, init, batches and
optimizer, stepped spec["steps"] times; its times, losses, norms, init checksum and peak RSS printed as one JSON
line after RESULT. Imports nothing of DeepSpeed on zoff's side."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RESULT = "BENCH_DEEPSPEED_RESULT "


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


@dataclass
class Side:
    """One side built and ready: its step (the step's index and lr -> the loss), what the run reports of its
    start, and how it ends."""

    step: Callable[[int, float], float]
    close: Callable[[], object]
    init_checksum: str
    params: int
    built_peak: int
    startup_s: float
    speculation: Callable[[], dict | None] = lambda: None  # zoff's counts (its recipes' speculate: auto)
    accelerator: str | None = None


def zoff_side(spec: dict, cfg, norms: list[float], t_start: float) -> Side:
    """zoff's engine as `zoff train` builds it on each rank, stepped as train_loop steps it."""
    import torch
    import torch.distributed as dist

    from zoff.trainer.loss import forward_loss
    from zoff.trainer.session import build_session

    dist.init_process_group("gloo", rank=0, world_size=1)
    s = build_session(cfg, torch.device("cpu"))
    engine, batches = s.engine, s.batches
    built_peak, startup = peak_rss(), time.perf_counter() - t_start
    # (fp32 masters, made from the bf16 shards as DeepSpeed makes its own)
    full = engine.gathered_params()
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

    def speculation() -> dict | None:
        zs = engine.speculation
        return dict(zs.counts) if zs is not None else None

    return Side(step, engine.close, init, params, built_peak, startup, speculation)


def deepspeed_model(cfg, dsc: dict, remote: str):
    """zoff's GPT under DeepSpeed's zero.Init, partitioned as built, then drawn with zoff's init one gathered
    parameter at a time (zoff's engine materialises its shards with the same init_parameter). The dtype comes
    from the config's bf16 section: 0.19.8's zero.Init, handed a dtype, takes bf16 on the CPU accelerator
    whatever it was given (`dtype or fp16 if fp16-capable else bf16 ...`: precedence), so an fp32 run computed
    in bf16."""
    import deepspeed
    import torch

    from zoff.models import build_model

    torch.manual_seed(cfg.train.seed)  # as build_session: the GPT draws its init seed from it
    with deepspeed.zero.Init(config_dict_or_path=dsc, remote_device=remote):
        model = build_model(cfg.model)
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            model.init_parameter(name, p.data)
    return model


def deepspeed_side(spec: dict, cfg, norms: list[float], t_start: float) -> Side:
    """DeepSpeed's ZeRO-3 engine on the same model, init, batches, AdamW groups and lr."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from zoff.data import GlobalBatches, load_corpus
    from zoff.models import lm_loss

    deepspeed.init_distributed(dist_backend="gloo")
    dsc = ds_config(spec, Path(spec["swap"]))
    model = deepspeed_model(cfg, dsc, spec["tier"] if spec["tier"] == "nvme" else "cpu")
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
    return Side(step, close, init, params, built_peak, startup, accelerator=get_accelerator().device_name())


def worker(spec: dict) -> dict:
    """One run of one side: build, train spec["steps"] steps, report times, losses, checksum and peak RSS."""
    import torch

    from zoff.trainer.schedule import lr_at

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    torch.set_num_threads(spec["threads"])
    cfg = zoff_config(spec, Path(spec["swap"]))
    norms: list[float] = []  # each step's global gradient norm, before the clip
    build = zoff_side if spec["side"] == "zoff" else deepspeed_side
    side = build(spec, cfg, norms, time.perf_counter())
    peak_rss(reset=True)  # the checksum's gathered copies are the benchmark's, not the run's: left out
    times, losses = [], []
    for i in range(spec["steps"]):
        t0 = time.perf_counter()
        losses.append(side.step(i, lr_at(i, cfg.optim.lr, cfg.train.max_steps, cfg.schedule)))
        times.append(time.perf_counter() - t0)
        print(f"{spec['side']} {spec['tier']} step {i + 1}: loss {losses[-1]:.4f} {times[-1]:.2f} s", flush=True)  # fmt: skip
    threads = torch.get_num_threads()
    speculation = side.speculation()
    side.close()
    peak = max(side.built_peak, peak_rss())
    return {"side": spec["side"], "tier": spec["tier"], "step_s": times, "losses": losses,
            "init_checksum": side.init_checksum, "params": side.params, "peak_rss_bytes": peak,
            "startup_s": side.startup_s, "threads_at_end": threads, "norms": norms, "speculation": speculation,
            "torch": torch.__version__, "accelerator": side.accelerator}  # fmt: skip


def main(argv: list[str]) -> int:
    """`python deepspeed_worker.py SPEC_JSON`: one side's run; its result on the last line, after RESULT."""
    print(RESULT + json.dumps(worker(json.loads(argv[0]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
