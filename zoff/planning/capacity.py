"""`zoff estimate --max-model`: the largest model of a ladder of standard GPT shapes each policy trains here.

Every number comes from zoff.planning.memory.estimate() and PolicyEstimate.fits() (the same arithmetic as the
`zoff estimate` table, `zero: auto` and the trainer's plan): this module only walks the ladder. One estimate()
per rung yields every policy at once, so a table costs at most len(LADDER) estimates.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from zoff.config import DataConfig, ModelConfig, TrainConfig, ZeroConfig
from zoff.engine.policy import POLICIES, Policy
from zoff.planning.memory import (
    Budget,
    Estimate,
    PolicyEstimate,
    changes_config,
    changes_text,
    estimate,
    fit_gathering,
    mlp_tiles,
)
from zoff.units import human

VOCAB = 32_000  # a Llama-style tokenizer: the rungs differ only in depth and width
NOTE = (
    "estimates, not GPU runs: zoff.planning.memory's arithmetic, the same functions tests hold equal to the "
    "engine's own allocations; the CUDA context and allocator fragmentation come on top"
)


@dataclass(frozen=True)
class Rung:
    """A published transformer shape, built as the builtin GPT (4x MLP, learned positions, untied head)."""

    label: str
    n_layer: int
    n_head: int
    d_model: int
    shape_of: str  # the published model with these layer/width/head counts


LADDER: tuple[Rung, ...] = (
    Rung("125M", 12, 12, 768, "GPT-3 Small"),
    Rung("350M", 24, 16, 1024, "GPT-3 Medium"),
    Rung("760M", 24, 16, 1536, "GPT-3 Large"),
    Rung("1.3B", 24, 32, 2048, "OPT-1.3B"),
    Rung("2.7B", 32, 32, 2560, "GPT-3 2.7B"),
    Rung("6.7B", 32, 32, 4096, "GPT-3 6.7B / Llama-7B"),
    Rung("13B", 40, 40, 5120, "Llama-13B"),
    Rung("30B", 48, 56, 7168, "OPT-30B"),
    Rung("65B", 80, 64, 8192, "Llama-65B / configs/gpt-70b.yaml"),
    Rung("175B", 96, 96, 12288, "GPT-3 175B"),
    Rung("405B", 126, 128, 16384, "Llama-3.1-405B"),
)


def rung_model(base: ModelConfig, rung: Rung) -> ModelConfig:
    """The builtin GPT of this rung; the base config keeps its context (seq_len) and dropout."""
    return ModelConfig(
        name="gpt", n_layer=rung.n_layer, n_head=rung.n_head, d_model=rung.d_model, vocab_size=VOCAB,
        seq_len=base.seq_len, dropout=base.dropout, tie_embeddings=False,
    )  # fmt: skip


@dataclass(frozen=True)
class Fit:
    """One policy's needs for one rung."""

    rung: Rung
    params: int
    pe: PolicyEstimate


@dataclass(frozen=True)
class Answer:
    policy: Policy
    largest: Fit | None  # the largest rung that fits; None: not even the smallest
    next: Fit | None  # the rung above it, which does not fit; None when `largest` is the ladder's top


@dataclass(frozen=True)
class Capacity:
    answers: tuple[Answer, ...]
    budget: Budget
    disk_source: str
    gpus_per_node: int
    nodes: int
    device_type: str
    data: DataConfig
    train: TrainConfig
    seq_len: int
    ladder: tuple[Rung, ...]


def max_model(
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
    ladder: tuple[Rung, ...] = LADDER,
    memo: dict[tuple, Estimate] | None = None,
) -> Capacity:
    """Per policy, the largest rung whose estimate fits `budget`, and the rung above it.

    The rungs are walked from the largest down, and each policy takes the first that fits: the largest one by
    construction, with no assumption that needs grow with size. The walk stops once every policy has its answer.
    memo ((rung label, host bytes[, the fallback's zero changes]) -> Estimate) lets callers that vary only the device budget reuse the
    estimates (the host's memory sets the disk tier's host budget: part of the key; the disk's free bytes,
    where speculation's second slots fit, only the RAM of a disk too short for them all: keep it too).
    """
    memo = {} if memo is None else memo
    found: dict[Policy, Fit] = {}
    above: dict[Policy, Fit] = {}  # the smallest rung seen so far that does not fit
    for rung in reversed(ladder):
        m = rung_model(model, rung)

        def at(z: ZeroConfig, m=m, label=rung.label) -> Estimate:
            # (the configured zero section: the key the memo's callers give; fit_gathering's changes added)
            key = (label, budget.cpu, *z.block_classes, z.overlap_comm)[: 2 if z == zero else None]
            if key not in memo:
                memo[key] = estimate(
                    m, data, train, z, gpus_per_node, nodes, device_type, budget.cpu,
                    disk_free=budget.disk or None,
                )  # fmt: skip
            return memo[key]

        # stage 3 part by part where whole layers do not fit
        est = fit_gathering(at(zero), budget, m, zero, at, mlp_tiles(train, data))
        for pe in est.policies:
            if pe.policy in found:
                continue
            fit = Fit(rung, est.params, pe)
            if pe.fits(budget):
                found[pe.policy] = fit
            else:
                above[pe.policy] = fit
        if len(found) == len(est.policies):
            break
    answers = tuple(Answer(p, found.get(p), above.get(p)) for p in row_order())
    return Capacity(
        answers, budget, disk_source, gpus_per_node, nodes, device_type, data, train, model.seq_len, ladder
    )


def row_order() -> list[Policy]:
    """POLICIES with each policy followed by its activation-checkpointing twin."""
    plain = [p for p in POLICIES if not p.activation_checkpointing]
    return [q for p in plain for q in (p, dataclasses.replace(p, activation_checkpointing=True))]


def row_label(p: Policy) -> str:
    return p.name + (" + act. ckpt" if p.activation_checkpointing else "")


def limited_by(pe: PolicyEstimate, budget: Budget) -> list[str]:
    """Which of the budget's resources `pe` exceeds: fits() itself, with the other resources made unlimited."""
    inf = 2**62
    checks = {
        "gpu": dataclasses.replace(budget, cpu=inf, disk=inf),
        "cpu": dataclasses.replace(budget, gpu=inf, disk=inf),
        "disk": dataclasses.replace(budget, gpu=inf, cpu=inf),
    }
    return [name for name, b in checks.items() if not pe.fits(b)]


# ---------------------------------------------------------------------------------------------- output


def _needs(fit: Fit) -> dict:
    pe = fit.pe
    r = fit.rung
    return {
        "model": r.label, "shape_of": r.shape_of, "n_layer": r.n_layer, "n_head": r.n_head,
        "d_model": r.d_model, "params": fit.params, "gpu_bytes": pe.gpu_bytes,
        "cpu_bytes_per_node": pe.cpu_bytes_per_node, "disk_bytes_per_node": pe.disk * pe.local_ranks,
        "zero_changes": changes_config(pe.zero_changes),  # fit_gathering
    }  # fmt: skip


def to_json(cap: Capacity) -> dict:
    b = cap.budget
    return {
        "note": NOTE,
        "gpus_per_node": cap.gpus_per_node,
        "nodes": cap.nodes,
        "world_size": cap.gpus_per_node * cap.nodes,
        "device_type": cap.device_type,
        "precision": cap.train.precision,
        "seq_len": cap.seq_len,
        "batch_size": cap.data.batch_size,
        "grad_accum": cap.train.grad_accum,
        "memory": memory_json(b, cap.disk_source),
        "ladder": [{**dataclasses.asdict(r), "vocab_size": VOCAB, "tie_embeddings": False} for r in cap.ladder],
        "policies": [
            {**a.policy.to_dict(), "name": a.policy.name, "label": row_label(a.policy),
             "largest": _needs(a.largest) if a.largest else None,
             "next": {**_needs(a.next), "limited_by": limited_by(a.next.pe, b)} if a.next else None}
            for a in cap.answers
        ],
    }  # fmt: skip


def memory_json(b: Budget, disk_source: str) -> dict:
    """The box a capacity table was answered for (--max-model's, --max-context's)."""
    return {
        "gpu_bytes": b.gpu, "cpu_bytes": b.cpu, "disk_bytes": b.disk, "shared": b.shared,
        "gpu_source": b.gpu_source, "cpu_source": b.cpu_source, "disk_source": disk_source,
    }  # fmt: skip


def memory_line(b: Budget, disk_source: str) -> str:
    """The box in words, under a capacity table."""
    memory = (
        f"the host's {human(b.cpu)}, shared by the ranks and the offloaded states ({b.gpu_source})"
        if b.shared
        else f"{human(b.gpu)} per GPU ({b.gpu_source}), {human(b.cpu)} CPU per node ({b.cpu_source})"
    )
    disk = f"{human(b.disk)} disk per node ({disk_source})" if b.disk else "no disk tier"
    return f"memory: {memory}; {disk}"


def _next_text(a: Answer, budget: Budget) -> str:
    if a.next is None:
        return "- (ladder top: a lower bound)"
    names = {"gpu": "GPU", "cpu": "host" if budget.shared else "CPU", "disk": "disk"}
    pe = a.next.pe
    sizes = {
        "gpu": human(pe.gpu_bytes),
        "cpu": human(pe.cpu_bytes_per_node),
        "disk": human(pe.disk * pe.local_ranks),
    }
    if budget.shared:  # no CUDA: the ranks' "GPU" bytes come out of the host's pool too (Budget.shared)
        sizes["cpu"] = f"{sizes['gpu']} x {pe.local_ranks} rank(s) + {sizes['cpu']}"
    over = ", ".join(f"{names[k]} {sizes[k]}" for k in limited_by(pe, budget))
    return f"{a.next.rung.label}: {over}"


def _parts_line(cap: Capacity) -> list[str]:
    changes = sorted(
        {pe.zero_changes for a in cap.answers if a.largest for pe in [a.largest.pe] if pe.zero_changes}
    )
    if not changes:
        return []
    which = " or ".join(changes_text(c) for c in changes)
    return [f"*: stage 3 with its layers gathered part by part ({which}): whole layers do not fit"]


def render(cap: Capacity) -> None:
    from rich.console import Console
    from rich.table import Table

    b = cap.budget
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 180)
    title = (
        f"Largest model each policy trains (estimated) on {cap.gpus_per_node} GPU(s) x {cap.nodes} node(s)"
    )
    table = Table(title=title, title_justify="left")
    for col in ("policy", "largest model", "params", "GPU", "CPU/node", "disk/node", "next rung needs"):
        table.add_column(
            col, justify="right" if col in ("params", "GPU", "CPU/node", "disk/node") else "left"
        )
    for a in cap.answers:
        if a.largest is None:
            table.add_row(row_label(a.policy), "none", "-", "-", "-", "-", _next_text(a, b), style="dim")
            continue
        f, pe = a.largest, a.largest.pe
        table.add_row(
            row_label(a.policy), f"{f.rung.label} ({f.rung.n_layer} x {f.rung.d_model}){' *' if pe.zero_changes else ''}",
            f"{f.params / 1e9:,.2f}B", human(pe.gpu_bytes), human(pe.cpu_bytes_per_node),
            human(pe.disk * pe.local_ranks) if pe.disk else "-", _next_text(a, b),
        )  # fmt: skip
    console.print(table)
    lines = [
        memory_line(b, cap.disk_source),
        f"ladder: {', '.join(r.label for r in cap.ladder)}: published layer x width x head counts built as the "
        f"builtin GPT (vocab {VOCAB}, untied head); from the config: context {cap.seq_len}, micro-batch "
        f"{cap.data.batch_size} x {cap.data.seq_len} tokens, grad_accum {cap.train.grad_accum}, "
        f"{cap.train.precision}",
        *([] if b.disk else ["nvme policies: no disk tier; pass --disk SIZE (or create zero.offload_optimizer.nvme_path)"]),
        *_parts_line(cap),
        f"These are {NOTE}.",
    ]  # fmt: skip
    for line in lines:
        console.print(line, soft_wrap=True)
