"""Random initialisation of an `hf:` model shard by shard (no model.path): built with its parameters on the
meta device, as a model read from a folder is (hf_shards.py), so each rank draws only the parameters that
meet its shards and no rank ever holds the whole model.

A parameter's initial value: the model's own `_init_weights`, applied to the module that owns the parameter
and then to each of its ancestors, children first as `model.apply` visits them (a parent that re-initialises
a child's weight, as GPT-2's scaled residual projections do, still does), with the host generator seeded by
the owner's name and one seed drawn when the model is built. Every other parameter stays on the meta device
meanwhile, where those calls do nothing. So a value depends on the seed and the name alone: the same on any
world size and the same as zoff's whole build of the model (`build_random_hf(..., whole=True)`), which draws
every parameter the same way. These are transformers' distributions, not its numbers: its whole-model init
walks one generator stream through every module, which no shard-by-shard init can reproduce.

A model whose `_init_weights` leaves a parameter untouched when applied this way (a custom nn.Parameter that
only a model-level override initialises) is found when it is built, alike on every rank (every draw replayed
on the meta device, at no memory cost): `build_random_hf` then returns None and the caller lets transformers
build it whole, as before.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zoff.models.hf_shards import empty_hf_model


class RandomInit:
    """init_parameter for a meta-device transformers model: parameter name -> its initial value."""

    def __init__(self, model: nn.Module, seed: int):
        self.model, self.seed = model, seed
        self.canonical: dict[str, str] = {}  # any name of a tied parameter -> its first name
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.canonical[name] = first.setdefault(id(p), name)

    @torch.no_grad()
    def __call__(self, name: str, out: torch.Tensor) -> None:
        if name not in self.canonical:
            raise KeyError(f"'{name}' is not a parameter of this model")
        owner, _, kind = self.canonical[name].rpartition(".")
        out.copy_(self.draw(owner)[kind])

    @torch.no_grad()
    def draw(self, owner: str, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Fresh values of every parameter that module `owner` holds directly (NaN where nothing drew one;
        on the meta device, shapes only: what undrawn() checks)."""
        module = self.model.get_submodule(owner)
        saved = dict(module._parameters)
        fresh = {
            k: torch.full(p.shape, float("nan"), device=device) for k, p in saved.items() if p is not None
        }
        chain = (
            [owner.rsplit(".", i)[0] if i else owner for i in range(owner.count(".") + 1)] if owner else []
        )
        modules = [self.model.get_submodule(m) for m in chain] + [self.model]  # the owner, then its ancestors
        try:
            for k, t in fresh.items():
                module._parameters[k] = nn.Parameter(t, requires_grad=saved[k].requires_grad)
            with torch.random.fork_rng(devices=[]):  # the trainer's own generator state is left as it was
                torch.manual_seed((self.seed + zlib.crc32(owner.encode())) % 2**63)
                for m in modules:
                    self.model._init_weights(m)
            return {k: module._parameters[k] for k in fresh}  # the fresh Parameters (undrawn() tracks them)
        finally:
            module._parameters.update(saved)

    def undrawn(self) -> str | None:
        """The first parameter `_init_weights` leaves untouched this way: every parameter's draw is replayed
        on the meta device (no memory, no arithmetic), noting which tensors an in-place op wrote."""
        for name in dict.fromkeys(self.canonical.values()):
            owner, _, kind = name.rpartition(".")
            with _Writes() as writes:
                fresh = self.draw(owner, device="meta")
            if id(fresh[kind]) not in writes.ids and fresh[kind].numel():
                return name
        return None


class _Writes(TorchFunctionMode):
    """The tensors that in-place functions (normal_, fill_, zero_, copy_, ...) were called on."""

    def __init__(self):
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch.nn.init's functions pass their tensor as tensor=, Tensor methods as the first argument
        target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        if getattr(func, "__name__", "").endswith("_") and isinstance(target, torch.Tensor):
            self.ids.add(id(target))
        return func(*args, **kwargs)


def build_random_hf(cls: type, config: Any, whole: bool) -> nn.Module | None:
    """`cls(config)` randomly initialised as this module says: parameters on the meta device with an
    init_parameter for the engine (`whole=False`), or every parameter drawn (`whole=True`). None when the
    model's `_init_weights` cannot initialise it this way."""
    model = empty_hf_model(cls, config)
    init = RandomInit(model, int(torch.randint(0, 2**62, ()).item()))  # one draw, as every build makes
    if init.undrawn() is not None:
        return None
    if whole:
        values: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            owner, _, kind = init.canonical[name].rpartition(".")
            if id(p) not in values:
                values[id(p)] = nn.Parameter(init.draw(owner)[kind].detach(), requires_grad=p.requires_grad)
            parent, _, key = name.rpartition(".")
            model.get_submodule(parent)._parameters[key] = values[id(p)]
    else:
        model.init_parameter = init  # an instance attribute: the engine looks for it on the model
    return model


def initialisable(cls: type, config: Any) -> bool:
    """Whether build_random_hf can build this model (checked on its meta-device structure)."""
    return RandomInit(empty_hf_model(cls, config), 0).undrawn() is None
