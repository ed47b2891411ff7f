"""A rank's run: its session built, resumed where asked, the start-up plan printed on rank 0 (plan_banner.py),
the fixed loop (loop.py) run on it, and the run's summary: model-state bytes and every rank's peak memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from zoff.checkpoint import Checkpointer
from zoff.checkpoint.base_ref import base_reference
from zoff.config import Config, dump_yaml
from zoff.engine import Comm
from zoff.models import model_flops_per_token
from zoff.trainer import disk_error
from zoff.trainer.compile import compile_seconds
from zoff.trainer.loop import train_loop
from zoff.trainer.metrics import MetricsWriter, peak_rss_slots, rank_logger
from zoff.trainer.plan_banner import model_state_bytes, plan_lines
from zoff.trainer.preempt import STOP
from zoff.trainer.session import build_session
from zoff.trainer.trackers import Trackers


def run_training(cfg: Config, run_dir: Path, device: torch.device, resume: str | None = None) -> dict | None:
    """Build this rank's session, resume if asked, print the plan on rank 0, and train."""
    stop = STOP.install()
    s = build_session(cfg, device)
    log = rank_logger(run_dir, s.comm.rank)
    ckpt = Checkpointer(
        s.engine, cfg.checkpoint, run_dir, dump_yaml(cfg), cfg.train.max_steps, base_reference(cfg.model)
    )
    start, state = ckpt.resume(resume)
    if state is not None:
        s.batches.load_state_dict(state["data"])
        log.info("resumed from step %d of %s", start, ckpt.dir)
    plan = plan_lines(s, torch.get_num_threads())
    for line in plan:
        log.info(line)
    writer = None
    if s.comm.rank == 0:
        print("\n".join(plan), flush=True)
        memory = {f"{k}_mib": v / 2**20 for k, v in s.engine.memory_report().items()}
        trackers = (
            Trackers(cfg.log, run_dir, cfg.to_dict(), memory) if cfg.log.wandb or cfg.log.mlflow else None
        )
        writer = MetricsWriter(
            run_dir, cfg.train.max_steps, start, cfg.log.progress, log, tensorboard=cfg.log.tensorboard,
            flops_per_token=model_flops_per_token(s.engine.model, cfg.model, cfg.data.seq_len),
            precision=s.engine.precision, device=device, trackers=trackers,
        )  # fmt: skip
        if state is not None:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            writer.event("resume", start, checkpoint=str(ckpt.dir), restart=restart, world_size=s.comm.world)
    s.writer, s.ckpt, s.start_step, s.stop = writer, ckpt, start, stop
    # a disk's I/O error, in a step, a save or the close's last write-backs: recorded for zoff train's one line
    with disk_error.recorded_on_failure(run_dir, s.comm.rank, ckpt.step_of):
        try:
            train_loop(s)
            peaks = ranks_peak_rss_mib(s.comm)  # (a collective: every rank, before the engine closes)
        except BaseException:
            if writer is not None and writer.trackers is not None:
                writer.trackers.close()  # the tracker runs end marked failed, not left running
            raise
        finally:
            s.engine.close()  # the disk tier's swap files go with a clean exit (and with an error)
    log.info("engine stats %s", json.dumps(s.engine.stats()))
    log.info("memory report %s", json.dumps(s.engine.memory_report()))
    held, ddp = model_state_bytes(s.engine)
    mib = {"model_state_mib_per_rank": held / 2**20, "ddp_model_state_mib_per_rank": ddp / 2**20}
    # the summary's peak RSS is the largest rank's (rank 0's alone hid a rank that held more), as each step's
    # record's is (its peak_rss_rank says which rank); each rank's beside it
    mib |= {"peak_rss_mib": max(peaks), "peak_rss_mib_per_rank": peaks}
    # steps whose loss or gradients were non-finite somewhere, none applied (this process's: a resume counts anew)
    mib["skipped_steps"] = s.engine.nonfinite_steps
    if s.compiled is not None:  # rank 0's compile time (every rank compiles its own, at about the same time)
        mib["compile_s"] = compile_seconds()
        log.info("train.compile: %.1f s compiling (forward and backward graphs)", mib["compile_s"])
    return writer.close(mib) if writer is not None else None


def ranks_peak_rss_mib(comm: Comm) -> list[float]:
    """Every rank's peak RSS so far, MiB, in rank order (one all-reduce of a vector, each rank's own slot)."""
    return comm.sum_scalars(peak_rss_slots(comm.rank, comm.world))
