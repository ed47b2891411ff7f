"""The fixed trainer loop: lr -> micro-batches -> step -> log -> eval -> save -> stop, read top to bottom."""

from __future__ import annotations

import time

import torch

from zoff.data import GlobalBatches
from zoff.engine import Comm, ZeroEngine
from zoff.trainer.loss import forward_loss
from zoff.trainer.metrics import peak_rss_slots
from zoff.trainer.nonfinite import note_stop
from zoff.trainer.schedule import lr_at
from zoff.trainer.session import Session


def train_loop(s: Session) -> list[float]:
    """lr -> micro-batches -> step -> log -> eval -> save -> stop. Steps are 1-based in logs (step k = k updates done)."""
    engine, batches, comm, train = s.engine, s.batches, s.comm, s.cfg.train
    accum = batches.grad_accum
    losses = []
    for step in range(s.start_step, train.max_steps):
        t0 = time.perf_counter()
        lr = lr_at(step, s.cfg.optim.lr, train.max_steps, s.cfg.schedule)
        engine.model.train()
        engine.zero_grad()
        # Summed on the device, read once per step: a .item() per micro-batch would wait for the GPU each time.
        local_loss = torch.zeros((), dtype=torch.float64, device=engine.device)
        forward_s = backward_s = 0.0  # host seconds (on a GPU, launches and the waits they meet)
        exchanged = s.sequence.stats.seconds, s.sequence.stats.elements  # train.sequence_parallel's, so far
        for micro in range(accum):
            batch = batches.micro_batch_at(step, micro)
            t1 = time.perf_counter()
            loss = forward_loss(engine.model, batch, accum, engine.device, train.loss_tile)
            t2 = time.perf_counter()
            # (the step's lr: its update may be computed during the last backward, speculate.py)
            engine.backward(loss, sync=micro == accum - 1, lr=lr)
            forward_s, backward_s = forward_s + t2 - t1, backward_s + time.perf_counter() - t2
            local_loss += loss.detach()
        result = engine.step(lr)
        # One all-reduce carries the loss, whether any rank was asked to stop (preemption), and each rank's peak
        # RSS in its own slot (the record's is the largest rank's, not rank 0's).
        mean_loss, stopping, *peaks = comm.sum_scalars(
            [
                float(local_loss) / comm.world,
                float(s.stop is not None and s.stop.requested),
                *peak_rss_slots(comm.rank, comm.world),
            ]
        )
        dt = time.perf_counter() - t0
        done = step + 1
        losses.append(mean_loss)
        # every rank decides alike: the step's result comes from the engine's all-reduce
        skipped = s.nonfinite.after(done, result) if s.nonfinite else None
        if skipped and comm.rank == 0:
            print(skipped, flush=True)
        if s.writer is not None:
            times = {"forward_s": forward_s, "backward_s": backward_s}
            if s.sequence.size > 1:  # rank 0's host seconds in the exchanges (waits too; a GPU's: launches)
                times["sequence_exchange_s"] = s.sequence.stats.seconds - exchanged[0]
                times["sequence_exchange_elements"] = (
                    s.sequence.stats.elements - exchanged[1]
                )  # sent by rank 0
            record = _step_record(s, done, mean_loss, lr, result, dt, times, peaks)
            if batch.loss_divisor is not None:  # fine-tuning: tokens_per_s counts padding and prompts too
                trained = round(batch.loss_divisor * comm.world)  # the global batch's trained tokens
                record |= {"trained_tokens": trained, "trained_tokens_per_s": trained / dt}
            last = done % train.log_every == 0 or done == train.max_steps or done == 1
            s.writer.step(record, write=last or skipped is not None)
        if done == train.max_steps:
            # a delayed (DPU) update still in flight lands before the final eval and save; after the step's
            # record, which (as every step's) holds the step alone, not the wait for its background update
            engine.flush()
        if (train.eval_every and done % train.eval_every == 0) or done == train.max_steps:
            val = evaluate(engine, batches, train.eval_batches, comm, train.loss_tile)
            if s.writer is not None:
                s.writer.eval(done, val)
        # (a periodic save waits out a streak of skipped steps: nonfinite.py; a stop's or the last one is made)
        streak = s.nonfinite is not None and s.nonfinite.in_streak and not stopping and done < train.max_steps
        if s.ckpt is not None and s.ckpt.due(done, stopping) and not streak:
            # "stop" marks the save a stop asked for: the launcher reads it back to say whether the stop's
            # checkpoint exists, rather than assuming it does.
            s.ckpt.save(done, {"step": done, "data": batches.state_dict(), "stop": bool(stopping)})
        if stopping:
            engine.flush()
            if s.writer is not None:
                s.writer.event("preempted", done)
            break
        if s.nonfinite is not None and s.nonfinite.must_stop():
            _stop_nonfinite(s, done)
            break
    return losses


def _stop_nonfinite(s: Session, done: int) -> None:
    """train.max_nonfinite_steps skipped in a row: the run ends here (the launcher says why, exit 1). Nothing of
    those steps was applied, so every checkpoint on disk holds finite values; none is written for this end."""
    engine, reason = s.engine, s.nonfinite.stop_reason()
    engine.flush()
    if s.writer is not None:
        s.writer.event("nonfinite_stop", done, reason=reason)
        note_stop(s.writer.path.parent, done, reason)


def _step_record(
    s: Session, done: int, loss: float, lr: float, result, dt: float, times: dict, peaks: list[float]
) -> dict:
    """What metrics.jsonl says of a step (rank 0's writer)."""
    return {
        "step": done,
        "loss": loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": s.batches.global_batch * s.batches.seq_len / dt,  # every token of the global batch
        "step_time_s": dt,
        "skipped": not result.stepped,
        **(
            {"nonfinite": result.nonfinite, "nonfinite_ranks": list(result.nonfinite_ranks)}
            if result.nonfinite
            else {}
        ),
        **times,  # forward and backward: the overlapped step's walk is inside the forward (it waits per block)
        "peak_rss_mib": max(peaks),
        "peak_rss_rank": peaks.index(max(peaks)),
        **s.engine.last_step_times,  # optimizer and publish seconds; on the disk tier its I/O and waits
    }


@torch.no_grad()
def evaluate(engine: ZeroEngine, batches: GlobalBatches, n_batches: int, comm: Comm, tile: int = 0) -> float:
    """Mean loss over the first n global batches of the val split (same batches every time)."""
    engine.model.eval()
    total, micro = 0.0, batches.val_batches(n_batches)
    for batch in micro:
        total += forward_loss(engine.model, batch, 1, engine.device, tile).item()
    (mean,) = comm.sum_scalars([total / len(micro) / comm.world])
    engine.model.train()
    return mean
