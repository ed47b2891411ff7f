"""Which policy a run gets: the fastest that fits a budget (suggest_policy, `zoff estimate --suggest`) and
`zero: auto` (resolve_auto), from memory.estimate's rows with the stage-3 fallbacks memory.fit_gathering
chose; where no policy fits one sequence, the smallest train.sequence_parallel N that makes one fit
(suggest_split)."""

from __future__ import annotations

import dataclasses

from zoff.config import DataConfig, ModelConfig, TrainConfig, ZeroConfig
from zoff.engine.policy import Policy
from zoff.errors import UserError
from zoff.planning.memory import Budget, Estimate, PolicyEstimate, changes_text, estimate_to_fit, shapes
from zoff.planning.sequence import choices
from zoff.planning.speculation_costs import swap_free_bytes
from zoff.units import human

# Fastest first. Stages 0-2 move the same 2 psi per step, so all three without recompute beat any of them with
# it; from there on each step costs more than activation checkpointing's extra forward (~1/3 of compute), so
# a policy is tried with recompute before falling to the next one.
_ORDER = [(0, "none", "none"), (1, "none", "none"), (2, "none", "none")]
_SLOW = [(2, "cpu", "none"), (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu")]
# Last, when even host memory cannot hold the states: the disk tier (only with an nvme_path that has room).
_SLOW += [(2, "nvme", "none"), (3, "nvme", "none"), (3, "nvme", "cpu"), (3, "nvme", "nvme")]
SUGGEST_ORDER = tuple(
    [Policy(*p, False) for p in _ORDER]
    + [Policy(*p, True) for p in _ORDER]
    + [Policy(*p, ac) for p in _SLOW for ac in (False, True)]
)


def suggest_policy(est: Estimate, budget: Budget) -> tuple[PolicyEstimate | None, str]:
    """The fastest policy that fits (SUGGEST_ORDER) and a one-line reason naming the next faster one's needs.

    A row that fits only with zero.overlap_comm off (fit_gathering: backward then waits on each reduction)
    comes after every row that fits without it."""

    def stalls(pe: PolicyEstimate) -> bool:
        return ("overlap_comm", False) in pe.zero_changes

    for allow_stall in (False, True):
        faster = None
        for pol in SUGGEST_ORDER:
            pe = est.get(pol)
            if pe.fits(budget) and (allow_stall or not stalls(pe)):
                why = f"; {policy_label(faster.policy)} needs {_needs(faster)}" if faster else ""
                how = f" with {changes_text(pe.zero_changes)}" if pe.zero_changes else ""
                return (
                    pe,
                    f"{policy_label(pol)}{how}: the fastest policy that fits {_budget_text(budget)} ({_needs(pe)}){why}",
                )
            faster = pe
    least = min(est.policies, key=lambda p: p.gpu_bytes)
    return None, (
        f"no policy fits {_budget_text(budget)}: the smallest, {policy_label(least.policy)}, needs {_needs(least)}; "
        "use more GPUs or a smaller data.batch_size / data.seq_len"
    )


def policy_label(p: Policy) -> str:
    return p.name + (" + activation checkpointing" if p.activation_checkpointing else "")


def _needs(pe: PolicyEstimate) -> str:
    disk = f", {human(pe.disk * pe.local_ranks)} disk per node" if pe.disk else ""
    return f"{human(pe.gpu_bytes)} per GPU, {human(pe.cpu_bytes_per_node)} CPU per node{disk}"


def resolve_auto(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    train_cfg: TrainConfig,
    zero_cfg: ZeroConfig,
    world: int,
    gpu_bytes: int,
    cpu_bytes: int,
    *,
    local_ranks: int | None = None,
    shared: bool = False,
    device_type: str = "cuda",
    split: bool = True,
) -> tuple[int, str, str, bool, str, dict, int]:
    """`zero: auto`: (stage, offload_optimizer device, offload_param device, activation checkpointing, reason,
    the zero-section changes its stage 3 needs to fit: {} for none; fit_gathering, train.sequence_parallel:
    the configured N, or with `split` the smallest larger one that makes a policy fit where none fits at it).

    local_ranks defaults to world (one node); shared means the ranks run on the host (no GPU) and share
    cpu_bytes. Raises UserError when nothing fits.
    """
    local = local_ranks or world
    if world % local:
        raise UserError(f"zero: auto: world size {world} is not a multiple of {local} ranks per node")
    budget = Budget(gpu_bytes, cpu_bytes, shared, disk=swap_free_bytes(zero_cfg))
    est = estimate_to_fit(
        model_cfg, data_cfg, train_cfg, zero_cfg, local, world // local, device_type, budget
    )
    pe, reason = suggest_policy(est, budget)
    n = train_cfg.sequence_parallel
    if pe is None and split:
        found = suggest_split(
            model_cfg, data_cfg, train_cfg, zero_cfg, local, world // local, device_type, budget
        )
        if found is not None:
            pe, reason, n = found
    if pe is None:
        raise UserError(f"zero: auto: {reason}")
    p = pe.policy
    return (
        p.stage,
        p.offload_optimizer,
        p.offload_param,
        p.activation_checkpointing,
        reason,
        dict(pe.zero_changes),
        n,
    )


def suggest_split(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    train_cfg: TrainConfig,
    zero_cfg: ZeroConfig,
    gpus_per_node: int,
    nodes: int,
    device_type: str,
    budget: Budget,
) -> tuple[PolicyEstimate, str, int] | None:
    """Where no policy fits at the configured train.sequence_parallel: the smallest larger N that divides the
    world, data.seq_len and the heads (sequence.choices) at which one does, as (its fastest policy's row, the
    reason naming N, N); None where no N makes one fit. The global batch stays (with_sequence_parallel)."""
    n0, world = train_cfg.sequence_parallel, gpus_per_node * nodes
    for n in choices(shapes(model_cfg), data_cfg.seq_len, n0, gpus_per_node, nodes):
        train = with_sequence_parallel(train_cfg, data_cfg, n, world)
        if train is None:
            continue
        est = estimate_to_fit(model_cfg, data_cfg, train, zero_cfg, gpus_per_node, nodes, device_type, budget)
        pe, reason = suggest_policy(est, budget)
        if pe is not None:
            return pe, _split_reason(reason, n, train_cfg, train, data_cfg, world), n
    return None


def _split_reason(
    reason: str, n: int, was: TrainConfig, now: TrainConfig, data: DataConfig, world: int
) -> str:
    """suggest_policy's reason at N = n, led by N and why it was chosen."""
    accum = (
        f"; grad_accum {now.grad_accum} keeps the global batch" if now.grad_accum != was.grad_accum else ""
    )
    return (
        f"train.sequence_parallel: {n}, {reason} (no policy fits {data.batch_size} sequence(s) of {data.seq_len:,} "
        f"tokens at train.sequence_parallel {was.sequence_parallel}; {n} is the smallest N that divides the world "
        f"of {world}, data.seq_len and the heads and makes one fit: each GPU holds 1/{n} of every sequence's "
        f"tokens{accum})"
    )


def with_sequence_parallel(train: TrainConfig, data: DataConfig, n: int, world: int) -> TrainConfig | None:
    """`train` at train.sequence_parallel N with its global batch (sequences per step) kept: grad_accum times
    N / the configured N where the batch follows from it, train.global_batch_size as set where the world / N
    data-parallel ranks divide it (else None: no N of the kind keeps it)."""
    if train.global_batch_size is None:
        accum = train.grad_accum * n // train.sequence_parallel  # (choices() gives multiples of it)
        return dataclasses.replace(train, sequence_parallel=n, grad_accum=accum)
    if train.global_batch_size % (data.batch_size * world // n):
        return None
    return dataclasses.replace(train, sequence_parallel=n)


def _budget_text(b: Budget) -> str:
    disk = f" and {human(b.disk)} of disk for swap files" if b.disk else ""
    if b.shared:
        return f"{human(b.cpu)} of host memory shared by the ranks{disk}"
    return f"{human(b.gpu)} per GPU and {human(b.cpu)} CPU per node{disk}"
