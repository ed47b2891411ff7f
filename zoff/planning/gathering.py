"""Stage 3's layers gathered part by part where whole layers do not fit (fit_gathering: the estimate's rows
re-chosen under stage3_fallbacks), what a row's changes are as config keys, and the meta models the estimate
reads (shapes). memory.py re-exports them: `zoff estimate`, --max-model, --max-context and `zero: auto` use the
same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from zoff.config import ModelConfig, ZeroConfig
from zoff.engine.policy import Policy
from zoff.models import meta_model
from zoff.planning.buffers import finer_gathering
from zoff.planning.fits import Budget, Estimate, PolicyEstimate


def stage3_fallbacks(model: nn.Module, mlp_tiles: int = 1) -> list[dict]:
    """zero-section changes that shrink stage 3's buffers, the cheapest first: the layers gathered part by
    part (buffers.finer_gathering; per Linear only where the MLP runs in one tile per micro-batch), then, per
    Linear, one gradient reduction in flight instead of MAX_IN_FLIGHT + 1 (zero.overlap_comm: false: a
    layer's gradients wait for the previous reduction, so backward stalls on communication; on a 16384-wide
    layer each reduction in flight holds 4 GiB in bf16)."""
    ladder: list[dict] = [{"block_classes": c} for c in finer_gathering(model, linear=mlp_tiles <= 1)]
    if ladder and ladder[-1]["block_classes"] == ("Linear",):
        ladder.append({**ladder[-1], "overlap_comm": False})
    return ladder


_SHAPES: dict[str, nn.Module] = {}


def shapes(model_cfg: ModelConfig) -> nn.Module:
    """meta_model(model_cfg), memoised by the section's repr (it holds dicts, so it does not hash) for the
    callers here, which only read it: `zoff estimate --max-model` and --max-context estimate each size with
    each stage-3 fallback, and a meta 405B took 0.2 s to build each time. A few models at most are kept."""
    key = repr(model_cfg)
    if key not in _SHAPES:
        if len(_SHAPES) >= 8:
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = meta_model(model_cfg)
    return _SHAPES[key]


def fit_gathering(
    est: Estimate,
    budget: Budget,
    model_cfg: ModelConfig,
    zero_cfg: ZeroConfig,
    at: Callable[[ZeroConfig], Estimate],
    tiles: int = 1,
) -> Estimate:
    """`est` with each stage-3 row that does not fit `budget` as configured replaced by its row under the first
    of stage3_fallbacks that fits (the row's zero_changes say which): the estimate choosing gathering below
    the layer where it is what makes a model fit. Nothing is tried where the config sets zero.block_classes
    (the user's gathering stands), and overlap_comm is only ever turned off. `at(zero)`: estimate() of the
    config with that zero section (the caller's memo); `tiles`: mlp_tiles() of the config.
    """
    missing = {pe.policy for pe in est.policies if pe.policy.stage == 3 and not pe.fits(budget)}
    if zero_cfg.block_classes or not missing:
        return est
    ladder: list[dict] = []
    for changes in stage3_fallbacks(shapes(model_cfg), tiles):
        if changes.get("overlap_comm", True) is False and not zero_cfg.overlap_comm:
            changes = {k: v for k, v in changes.items() if k != "overlap_comm"}
        if changes not in ladder:
            ladder.append(changes)
    seen: dict[tuple, dict[Policy, PolicyEstimate]] = {}

    def rows(changes: dict) -> dict[Policy, PolicyEstimate]:
        key = tuple(changes.items())
        if key not in seen:
            zero = dataclasses.replace(zero_cfg, **changes_config(changes))
            seen[key] = {pe.policy: pe for pe in at(zero).policies}
        return seen[key]

    # The last fallback needs the least: where even it does not fit, the others are not tried (the --max-model
    # walk meets many such rungs).
    if not ladder or not any(pe.fits(budget) for p, pe in rows(ladder[-1]).items() if p in missing):
        return est
    chosen: dict[Policy, PolicyEstimate] = {}
    for changes in ladder:
        for p, pe in rows(changes).items():
            if p in missing and p not in chosen and pe.fits(budget):
                chosen[p] = dataclasses.replace(pe, zero_changes=tuple(changes.items()))
        if len(chosen) == len(missing):
            break
    return dataclasses.replace(est, policies=tuple(chosen.get(pe.policy, pe) for pe in est.policies))


def changes_config(changes) -> dict:
    """A row's zero_changes (pairs, or a dict) as ZeroConfig / JSON values: block_classes a list."""
    pairs = changes.items() if isinstance(changes, dict) else changes
    return {k: list(v) if isinstance(v, tuple) else v for k, v in pairs}


def changes_text(changes: tuple[tuple[str, object], ...]) -> str:
    """A row's zero_changes as config keys: "zero.block_classes: [Linear], zero.overlap_comm: false"."""

    def value(v: object) -> str:
        return f"[{', '.join(v)}]" if isinstance(v, tuple) else str(v).lower()

    return ", ".join(f"zero.{k}: {value(v)}" for k, v in changes)
