"""The partition plan: which rank owns which slice of which parameter. An immutable value from pure functions.

Trainable parameters are laid out in *units*: flat, padded buffers that are the granularity of every
collective (a gradient bucket for stages 0-2, a module's parameters for stage 3). Each unit is split evenly
across the ranks, so rank r owns elements [r*shard, (r+1)*shard) of every unit. Inside a unit the
weight-decayed parameters come first, so a rank's shard meets at most two runs with different decay: the
optimizer steps each run as one contiguous tensor instead of one call per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """One distinct trainable parameter: where it lies in its unit. `names` holds tied aliases too."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    numel: int
    unit: int
    offset: int
    decay: bool


@dataclass(frozen=True)
class Unit:
    index: int
    slots: tuple[int, ...]  # indices into PartitionPlan.slots, in layout order
    numel: int
    padded: int  # numel rounded up to a multiple of world_size
    shard: int  # padded // world_size: what each rank owns
    decay_numel: int  # elements [0, decay_numel) take weight decay
    persistent: bool  # stage 3: kept whole on every rank (small params), only its optimizer state is sharded
    modules: tuple[str, ...]  # modules whose direct parameters live here (stage 3 gathers by module)


@dataclass(frozen=True)
class PartitionPlan:
    world_size: int
    slots: tuple[Slot, ...]
    units: tuple[Unit, ...]
    frozen: tuple[str, ...]  # frozen parameters stay whole on every rank and have no optimizer state

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def shard_range(self, unit: int, rank: int) -> tuple[int, int]:
        size = self.units[unit].shard
        return rank * size, (rank + 1) * size

    def decay_runs(self, unit: int, rank: int) -> list[tuple[int, int, bool]]:
        """Runs (start, end, decay) of rank's shard, in shard-local coordinates; at most two."""
        u = self.units[unit]
        lo, hi = self.shard_range(unit, rank)
        runs = []
        if lo < u.decay_numel:
            runs.append((0, min(hi, u.decay_numel) - lo, True))
        if hi > u.decay_numel:
            start = max(lo, u.decay_numel)
            runs.append((start - lo, hi - lo, False))
        return runs

    def pieces(self, slot: int) -> list[tuple[int, int, int]]:
        """Where a parameter's flat elements lie: (rank, start in the flattened param, length) per owning rank.

        Rank r's piece starts at offset + param_start - r*shard in its shard of the unit; checkpoints use this
        to read exactly the byte ranges a rank needs.
        """
        s = self.slots[slot]
        u = self.units[s.unit]
        out = []
        for r in range(self.world_size):
            lo, hi = self.shard_range(s.unit, r)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((r, a - s.offset, b - a))
        assert sum(p[2] for p in out) == s.numel or u.numel == 0
        return out

    def shard_numel(self) -> int:
        return sum(u.shard for u in self.units)


def default_decay(name: str, p: torch.Tensor) -> bool:
    """Matrices and embeddings take weight decay; biases and norm gains do not (nanoGPT's rule)."""
    return p.dim() >= 2


def plan_partition(
    model: nn.Module,
    world_size: int,
    bucket_numel: int,
    *,
    per_module: bool = False,
    persistence_threshold: int = 0,
    decay_fn=default_decay,
) -> PartitionPlan:
    """Group the model's distinct trainable parameters into padded units and split each across ranks.

    per_module (stage 3): one unit per module's direct parameters, so a module gathers exactly what it uses;
    parameters with at most `persistence_threshold` elements go to persistent units, bucketed by size.
    Otherwise parameters are bucketed by `bucket_numel` in module order (close to the order gradients arrive).
    """
    seen: dict[int, int] = {}
    aliases: dict[int, list[str]] = {}
    frozen: list[str] = []
    groups: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []  # (module name, its new distinct params)
    users: dict[int, list[str]] = {}  # param id -> modules that own it directly (tied weights: several)
    for mod_name, mod in model.named_modules():
        fresh = []
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if not p.requires_grad:
                frozen.append(full)
                continue
            users.setdefault(id(p), []).append(mod_name)
            if id(p) in seen:
                aliases[id(p)].append(full)
                continue
            seen[id(p)] = 0
            aliases[id(p)] = [full]
            fresh.append((full, p))
        if fresh:
            groups.append((mod_name, fresh))

    # Build the unit membership first (lists of params), then lay each unit out.
    members: list[tuple[list[tuple[str, torch.Tensor]], bool]] = []
    bucket: list[tuple[str, torch.Tensor]] = []
    small: list[tuple[str, torch.Tensor]] = []
    size = small_size = 0

    def flush(items: list, persistent: bool) -> None:
        if items:
            members.append((list(items), persistent))
            items.clear()

    for _, params in groups:
        if per_module:
            big = [(n, p) for n, p in params if p.numel() > persistence_threshold]
            for n, p in params:
                if p.numel() <= persistence_threshold:
                    if small and small_size + p.numel() > bucket_numel:
                        flush(small, True)
                        small_size = 0
                    small.append((n, p))
                    small_size += p.numel()
            flush(big, False)
            continue
        for n, p in params:
            if bucket and size + p.numel() > bucket_numel:
                flush(bucket, False)
                size = 0
            bucket.append((n, p))
            size += p.numel()
    flush(bucket, False)
    flush(small, True)

    slots: list[Slot] = []
    units: list[Unit] = []
    for ui, (params, persistent) in enumerate(members):
        ordered = [x for x in params if decay_fn(*x)] + [x for x in params if not decay_fn(*x)]
        offset, idx, decay_numel = 0, [], 0
        mods: list[str] = []
        for name, p in ordered:
            decay = decay_fn(name, p)
            idx.append(len(slots))
            slots.append(Slot(tuple(aliases[id(p)]), tuple(p.shape), p.numel(), ui, offset, decay))
            offset += p.numel()
            decay_numel += p.numel() if decay else 0
            mods.extend(m for m in users[id(p)] if m not in mods)
        padded = -(-offset // world_size) * world_size
        units.append(
            Unit(ui, tuple(idx), offset, padded, padded // world_size, decay_numel, persistent, tuple(mods))
        )
    return PartitionPlan(world_size, tuple(slots), tuple(units), tuple(frozen))
