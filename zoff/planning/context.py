"""`zoff estimate --max-context`: the longest sequence each policy trains the config's model at, here.

Every number comes from zoff.planning.memory.estimate() and PolicyEstimate.fits(), as `--max-model`'s do
(capacity.py); this module only searches the context length. The config's model keeps its shape and the
micro-batch its sequence count; the context (model.seq_len and data.seq_len together: the builtin GPT's
learned positions grow with it) is tried at 1K, 2K, ... 32M tokens, then narrowed to STEP tokens between the
longest length that fits and the next. One estimate() per length answers every policy, and lengths are
shared between policies, so a table costs a few dozen estimates. Under train.sequence_parallel N each rank
holds seq / N tokens of the sequence, and the lengths are multiples of N as well (step_of).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

from zoff.config import DataConfig, ModelConfig, TrainConfig, ZeroConfig
from zoff.engine.policy import Policy
from zoff.planning.capacity import NOTE, limited_by, memory_json, memory_line, row_label, row_order
from zoff.planning.memory import (
    Budget,
    Estimate,
    PolicyEstimate,
    changes_config,
    changes_text,
    estimate,
    fit_gathering,
    mlp_tiles,
    shapes,
)
from zoff.planning.sequence import check as check_sequence
from zoff.units import human

STEP = 1024  # the answer's granularity, in tokens
RUNGS = 16
LADDER = tuple(STEP << k for k in range(RUNGS))  # 1K .. 32M tokens


def step_of(n: int) -> int:
    """The granularity at train.sequence_parallel N: STEP tokens, and a multiple of N (each rank holds seq / N)."""
    return STEP * n // math.gcd(STEP, n)


@dataclass(frozen=True)
class ContextFit:
    seq_len: int
    pe: PolicyEstimate


@dataclass(frozen=True)
class ContextAnswer:
    policy: Policy
    longest: ContextFit | None  # None: not even STEP tokens fit
    next: ContextFit | None  # STEP tokens more, which do not fit; None when `longest` is the ladder's top


@dataclass(frozen=True)
class ContextCapacity:
    answers: tuple[ContextAnswer, ...]
    budget: Budget
    disk_source: str
    gpus_per_node: int
    nodes: int
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    step: int = STEP  # step_of(train.sequence_parallel): the lengths tried are its multiples


def max_context(
    model: ModelConfig,
    data: DataConfig,
    train: TrainConfig,
    zero: ZeroConfig,
    budget: Budget,
    gpus_per_node: int,
    nodes: int = 1,
    device_type: str = "cuda",
    *,
    disk_source: str = "given",
) -> ContextCapacity:
    """Per policy, the longest context (a multiple of step_of(N) up to the ladder's top) whose estimate fits; one
    line where train.sequence_parallel N does not divide the world or the heads."""
    n = train.sequence_parallel
    step = step_of(n)
    ladder = tuple(step << k for k in range(RUNGS))
    check_sequence(shapes(model), step, n, gpus_per_node, nodes)
    memo: dict[int, Estimate] = {}

    def at(seq: int) -> dict[Policy, PolicyEstimate]:
        if seq not in memo:
            m = dataclasses.replace(model, seq_len=seq)
            d = dataclasses.replace(data, seq_len=seq)

            def at(z: ZeroConfig, m=m, d=d) -> Estimate:
                return estimate(
                    m, d, train, z, gpus_per_node, nodes, device_type, budget.cpu,
                    disk_free=budget.disk or None,
                )  # fmt: skip

            # stage 3 part by part where whole layers do not fit
            memo[seq] = fit_gathering(at(zero), budget, m, zero, at, mlp_tiles(train, d))
        return {pe.policy: pe for pe in memo[seq].policies}

    answers = []
    for policy in row_order():
        fits = [seq for seq in ladder if at(seq)[policy].fits(budget)]
        if not fits:
            answers.append(ContextAnswer(policy, None, ContextFit(step, at(step)[policy])))
            continue
        lo = fits[-1]  # the longest ladder length that fits; needs grow with the length between rungs
        if lo == ladder[-1]:
            answers.append(ContextAnswer(policy, ContextFit(lo, at(lo)[policy]), None))
            continue
        hi = lo * 2  # does not fit
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            lo, hi = (mid, hi) if at(mid)[policy].fits(budget) else (lo, mid)
        answers.append(ContextAnswer(policy, ContextFit(lo, at(lo)[policy]), ContextFit(hi, at(hi)[policy])))
    return ContextCapacity(
        tuple(answers), budget, disk_source, gpus_per_node, nodes, model, data, train, step
    )


# ---------------------------------------------------------------------------------------------- output


def _needs(fit: ContextFit) -> dict:
    pe = fit.pe
    return {
        "seq_len": fit.seq_len, "gpu_bytes": pe.gpu_bytes, "activation_bytes": pe.gpu.get("activations", 0),
        "cpu_bytes_per_node": pe.cpu_bytes_per_node, "disk_bytes_per_node": pe.disk * pe.local_ranks,
        "zero_changes": changes_config(pe.zero_changes),  # fit_gathering
    }  # fmt: skip


def to_json(cap: ContextCapacity) -> dict:
    b = cap.budget
    return {
        "note": NOTE,
        "model": cap.model.name, "batch_size": cap.data.batch_size, "precision": cap.train.precision,
        "loss_tile": cap.train.loss_tile, "gpus_per_node": cap.gpus_per_node, "nodes": cap.nodes,
        # ranks sharing each sequence: the bytes are one rank's, of seq_len / N tokens of every sequence
        "sequence_parallel": cap.train.sequence_parallel,
        "memory": memory_json(b, cap.disk_source),
        "policies": [
            {**a.policy.to_dict(), "name": a.policy.name, "label": row_label(a.policy),
             "longest": _needs(a.longest) if a.longest else None,
             "next": {**_needs(a.next), "limited_by": limited_by(a.next.pe, b)} if a.next else None}
            for a in cap.answers
        ],
    }  # fmt: skip


def _tokens(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20:,}M"
    return f"{n // 1024:,}K" if n % 1024 == 0 else f"{n:,}"


def top(cap: ContextCapacity) -> int:
    """The ladder's longest length: an answer there is a lower bound."""
    return cap.step << (RUNGS - 1)


def render(cap: ContextCapacity) -> None:
    from rich.console import Console
    from rich.table import Table

    b = cap.budget
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 180)
    n = cap.train.sequence_parallel
    split = f", each sequence split over {n} of them (train.sequence_parallel)" if n > 1 else ""
    table = Table(
        title=f"Longest context each policy trains (estimated) on {cap.gpus_per_node} GPU(s) x {cap.nodes} node(s)"
        + split,
        title_justify="left",
    )
    for col in (
        "policy",
        "longest context",
        "GPU",
        "of it activations",
        "CPU/node",
        "disk/node",
        "next needs",
    ):
        table.add_column(col, justify="left" if col in ("policy", "next needs") else "right")
    for a in cap.answers:
        nxt = f"- ({_tokens(top(cap))} tokens: a lower bound)"
        if a.next is not None:
            over = limited_by(a.next.pe, b)
            sizes = {"gpu": human(a.next.pe.gpu_bytes), "cpu": human(a.next.pe.cpu_bytes_per_node),
                     "disk": human(a.next.pe.disk * a.next.pe.local_ranks)}  # fmt: skip
            nxt = f"{_tokens(a.next.seq_len)}: " + ", ".join(f"{k} {sizes[k]}" for k in over)
        if a.longest is None:
            table.add_row(row_label(a.policy), "none", "-", "-", "-", "-", nxt, style="dim")
            continue
        pe = a.longest.pe
        table.add_row(
            row_label(a.policy), _tokens(a.longest.seq_len) + (" *" if pe.zero_changes else ""), human(pe.gpu_bytes),
            human(pe.gpu.get("activations", 0)), human(pe.cpu_bytes_per_node),
            human(pe.disk * pe.local_ranks) if pe.disk else "-", nxt,
        )  # fmt: skip
    console.print(table)
    tile = f"loss tile {cap.train.loss_tile}" if cap.train.loss_tile else "untiled loss (train.loss_tile)"
    lines = [
        memory_line(b, cap.disk_source),
        f"model: {cap.model.name} as configured, context (model.seq_len = data.seq_len) searched in {cap.step}-token "
        f"steps up to {_tokens(top(cap))}; micro-batch {cap.data.batch_size} sequence(s), {cap.train.precision}, {tile}",
        *([f"per GPU: 1/{n} of every sequence's tokens (activations, the loss and the MLP on them); attention "
           f"over the whole sequence for 1/{n} of the heads, two all-to-alls a layer; ZeRO shards over all "
           f"{cap.gpus_per_node * cap.nodes} GPUs"] if n > 1 else []),
        *(["*: stage 3 with its layers gathered part by part there: " + "; ".join(sorted(
            {changes_text(a.longest.pe.zero_changes) for a in cap.answers if a.longest and a.longest.pe.zero_changes}
        ))] if any(a.longest and a.longest.pe.zero_changes for a in cap.answers) else []),
        f"These are {NOTE}.",
    ]  # fmt: skip
    for line in lines:
        console.print(line, soft_wrap=True)
