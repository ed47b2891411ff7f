"""The partition plan: which rank owns which slice of which parameter. An immutable value from pure functions.

Trainable parameters are laid out in *units*: flat, padded buffers that are the granularity of every
collective (a gradient bucket; at stage 3 one module's at most, and a block's units are gathered together).
Each unit is split evenly across the ranks, so rank r owns elements [r*shard, (r+1)*shard) of every unit.
Inside a unit the weight-decayed parameters come first, so a rank's shard meets at most two runs with
different decay: the optimizer steps each run as one contiguous tensor instead of one call per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    modules: tuple[str, ...]  # stage 3: the block whose forward gathers this unit ("" for the root unit)


@dataclass(frozen=True)
class PartitionPlan:
    """`slots`/`units` are the trainable parameters; stage 3 also partitions frozen ones, in `frozen_units`
    (numbered after the trainable units, their slots after the trainable slots: `all_units`/`all_slots`),
    which are gathered like the others and have no gradient and no optimizer state."""

    world_size: int
    slots: tuple[Slot, ...]
    units: tuple[Unit, ...]
    frozen: tuple[str, ...]  # frozen parameters kept whole on every rank (no optimizer state either)
    frozen_slots: tuple[Slot, ...] = ()
    frozen_units: tuple[Unit, ...] = ()

    @property
    def all_slots(self) -> tuple[Slot, ...]:
        return self.slots + self.frozen_slots

    @property
    def all_units(self) -> tuple[Unit, ...]:
        return self.units + self.frozen_units

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def shard_range(self, unit: int, rank: int) -> tuple[int, int]:
        size = self.all_units[unit].shard
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
        s = self.all_slots[slot]
        u = self.all_units[s.unit]
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


def find_blocks(model: nn.Module, classes: tuple[str, ...] = ()) -> list[str]:
    """The repeated layers stage 3 gathers whole (a block's units together), in module order.

    A block is a module whose class is in `classes` (zero.block_classes: the user's choice of gather unit,
    such as a MoE layer whose experts not every rank runs; the model's own class makes the whole model the
    root, gathered whole) or in HF's `_no_split_modules`, or an element of a ModuleList or
    Sequential of two or more modules of one class (a transformer's layers), unless `classes` names modules
    inside those layers: then the layers' parts of those classes are the blocks (a layer too big to gather
    twice, gathered part by part: its other parameters, norms mostly, go with the root), and a class named
    for the layers' parts picks nothing outside them (["Linear"] gathers each linear of the layers, not the
    output head, which the loss may read outside any call of it). Blocks do not nest: a MoE block's expert
    list is part of its block. Gathering a whole block (FSDP2's unit) lets any code inside its forward read
    any of its parameters, a parent reading a child's weight included.
    """
    if type(model).__name__ in classes:  # the model itself: all root, gathered whole for every forward
        return []
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    lists = layer_lists(model)
    # the classes found inside the layers (the layers' own excluded): naming one gathers the layers part by part
    inner = {
        type(m).__name__ for layers in lists for layer in layers for m in layer.modules() if m is not layer
    }
    part_classes = set(classes) & inner
    out: list[str] = []

    def walk(module: nn.Module, prefix: str, in_layers: bool) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            kind = type(child).__name__
            if in_layers:  # inside layers gathered part by part: the outermost named module is the block
                if kind in classes:  # (a layer whose own class is named stays whole: the larger unit wins)
                    out.append(name)
                else:
                    walk(child, name, True)
            elif kind in (no_split | set(classes)) - part_classes and not (
                kind in no_split and any(type(m).__name__ in part_classes for m in child.modules())
            ):
                out.append(name)
            elif any(child is layers for layers in lists):
                if any(type(m).__name__ in part_classes for m in child.modules()):
                    walk(child, name, True)  # the user named parts of the layers (gathering below the block)
                else:
                    out.extend(f"{name}.{i}" for i, _ in child.named_children())
            else:
                walk(child, name, False)

    walk(model, "", False)
    return out


def _is_layer_list(m: nn.Module) -> bool:
    return isinstance(m, nn.ModuleList | nn.Sequential) and len(m) >= 2 and len({type(c) for c in m}) == 1


def layer_lists(model: nn.Module) -> list[nn.Module]:
    """The outermost lists of two or more modules of one class (a transformer's layers)."""
    out: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if _is_layer_list(child):
                out.append(child)
            else:
                walk(child)

    walk(model)
    return out


def plan_partition(
    model: nn.Module,
    world_size: int,
    bucket_numel: int,
    *,
    per_block: bool = False,
    persistence_threshold: int = 0,
    block_classes: tuple[str, ...] = (),
    decay_fn=default_decay,
) -> PartitionPlan:
    """Group the model's distinct trainable parameters into padded units and split each across ranks.

    per_block (stage 3): each block's (find_blocks) and the root's parameters (every one outside the blocks:
    embeddings, final norm, head; gathered from the start of forward to the end of backward) are bucketed by
    `bucket_numel` module by module, so a block is gathered whole but reduced per module; parameters with at
    most `persistence_threshold` elements go to persistent units, bucketed by size. Otherwise parameters are
    bucketed by `bucket_numel` in module order.

    Unit order is the reduction order reversed (gradients are reduced from the last unit to the first, the
    order in which backward usually completes them): persistent units first, then the root, then blocks.
    """
    blocks = find_blocks(model, block_classes) if per_block else []
    walk = _walk(model, blocks)
    # Stage 3 partitions frozen parameters too (a frozen base under LoRA is most of the model); small ones and
    # every frozen one at stages 0-2 stay whole.
    big_still = [(n, p) for n, p in walk.still if per_block and p.numel() > persistence_threshold]
    whole = {id(p) for n, p in walk.still} - {id(p) for n, p in big_still}
    frozen = [a for n, p in walk.still if id(p) in whole for a in walk.aliases[id(p)]]
    if per_block:
        members = _block_members(walk, blocks, bucket_numel, persistence_threshold)
    else:
        members = [(bucket, False, ()) for bucket in _buckets(walk.ordered, bucket_numel)]
    frozen_members = []
    for group in ["", *blocks]:
        params = [(n, p) for n, p in big_still if walk.owner[id(p)] == group]
        if params:
            frozen_members.append((params, False, (group,)))
    slots, units = _layout(members + frozen_members, world_size, walk.aliases, decay_fn)
    n_units, n_slots = len(members), sum(len(m[0]) for m in members)
    return PartitionPlan(
        world_size, tuple(slots[:n_slots]), tuple(units[:n_units]), tuple(frozen),
        tuple(slots[n_slots:]), tuple(units[n_units:]),
    )  # fmt: skip


Named = list[tuple[str, torch.Tensor]]
Member = tuple[Named, bool, tuple[str, ...]]  # a unit's params, persistent?, the block it belongs to


@dataclass
class _Walk:
    aliases: dict[int, list[str]] = field(default_factory=dict)  # param id -> every name it has
    ordered: Named = field(default_factory=list)  # distinct trainable params, in module order
    still: Named = field(default_factory=list)  # distinct frozen params, in module order
    owner: dict[int, str] = field(default_factory=dict)  # param id -> its block ("" for the root)
    module_of: dict[int, str] = field(default_factory=dict)  # param id -> the module holding it directly


def _walk(model: nn.Module, blocks: list[str]) -> _Walk:
    w = _Walk()
    first = {}  # block -> its place in `blocks`: a module's block is the first one that is it or holds it
    for i, b in enumerate(blocks):
        first.setdefault(b, i)
    for mod_name, mod in model.named_modules():
        parts = mod_name.split(".")
        held_by = [first[q] for q in (".".join(parts[: j + 1]) for j in range(len(parts))) if q in first]
        block = blocks[min(held_by)] if held_by else ""
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if id(p) in w.aliases:
                w.aliases[id(p)].append(full)
                continue
            w.aliases[id(p)] = [full]
            w.owner[id(p)] = block
            w.module_of[id(p)] = mod_name
            (w.ordered if p.requires_grad else w.still).append((full, p))
    return w


def _block_members(walk: _Walk, blocks: list[str], bucket_numel: int, threshold: int) -> list[Member]:
    """Stage 3: small params bucketed into persistent units, then the root's and each block's params."""
    small = [(n, p) for n, p in walk.ordered if p.numel() <= threshold]
    members: list[Member] = [(bucket, True, ()) for bucket in _buckets(small, bucket_numel)]
    large: dict[str, Named] = {}  # each block's (and the root's) params above the threshold, in module order
    for n, p in walk.ordered:
        if p.numel() > threshold:
            large.setdefault(walk.owner[id(p)], []).append((n, p))
    for group in ["", *blocks]:
        params = large.get(group, [])
        # A block is gathered whole but reduced module by module (bucket-sized at most): the gradients
        # waiting for their reduction are a module's, not a block's.
        by_module: dict[str, Named] = {}
        for n, p in params:
            by_module.setdefault(walk.module_of[id(p)], []).append((n, p))
        for mod_params in by_module.values():
            members += [(bucket, False, (group,)) for bucket in _buckets(mod_params, bucket_numel)]
    return members


def _layout(
    members: list[Member], world_size: int, aliases: dict[int, list[str]], decay_fn
) -> tuple[list, list]:
    """Slots and padded units, in member order; decayed params first within a trainable unit."""
    slots: list[Slot] = []
    units: list[Unit] = []
    for params, persistent, mods in members:
        trainable = params[0][1].requires_grad
        if trainable:
            params = [x for x in params if decay_fn(*x)] + [x for x in params if not decay_fn(*x)]
        offset, idx, decay_numel, ui = 0, [], 0, len(units)
        for name, p in params:
            decay = trainable and decay_fn(name, p)
            idx.append(len(slots))
            slots.append(Slot(tuple(aliases[id(p)]), tuple(p.shape), p.numel(), ui, offset, decay))
            offset += p.numel()
            decay_numel += p.numel() if decay else 0
        padded = -(-offset // world_size) * world_size
        units.append(
            Unit(ui, tuple(idx), offset, padded, padded // world_size, decay_numel, persistent, mods)
        )
    return slots, units


def _buckets(params: list[tuple[str, torch.Tensor]], numel: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of `params` of at most `numel` elements each (a larger parameter alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for n, p in params:
        if not out or size + p.numel() > numel:
            out.append([])
            size = 0
        out[-1].append((n, p))
        size += p.numel()
    return out
