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
                # the host generator only (torch.manual_seed would reseed the GPUs' too, not restored here)
                torch.random.default_generator.manual_seed((self.seed + zlib.crc32(owner.encode())) % 2**63)
                for m in modules:
                    self.model._init_weights(m)
            return {k: module._parameters[k] for k in fresh}  # the fresh Parameters (undrawn() tracks them)
        finally:
            module._parameters.update(saved)

    def undrawn(self) -> str | None:
        """The first parameter `_init_weights` leaves unset this way: every parameter's draw is replayed on
        the meta device (no memory, no arithmetic), noting which tensors a filling in-place op wrote whole."""
        for name in dict.fromkeys(self.canonical.values()):
            owner, _, kind = name.rpartition(".")
            with _Writes() as writes:
                fresh = self.draw(owner, device="meta")
                drawn = writes.whole(fresh[kind])
            if not drawn and fresh[kind].numel():
                return name
        return None


# In-place ops that change values without setting them: alone, they leave a parameter undrawn (NaN * 2).
_ARITHMETIC = frozenset(
    "add_ sub_ mul_ div_ pow_ neg_ abs_ sqrt_ exp_ log_ clamp_ clamp_min_ clamp_max_ addcmul_ addcdiv_ lerp_".split()
)


class _Writes(TorchFunctionMode):
    """The tensors that filling in-place functions (normal_, fill_, zero_, copy_, torch.nn.init's ...) were
    called on whole: on the tensor itself or on its `.data`, not on a slice of it (`weight[0].zero_()`
    sets one row) and not through arithmetic alone."""

    def __init__(self):
        super().__init__()
        self.ids: set[int] = set()
        self.data_of: dict[int, int] = {}  # id(t.data) -> id(t)
        self.keep: list[torch.Tensor] = []  # the .data tensors, alive so their ids stay theirs

    def whole(self, t: torch.Tensor) -> bool:
        return id(t) in self.ids

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (
            name == "__get__"
            and args
            and isinstance(out, torch.Tensor)
            and getattr(func, "__self__", None) is torch.Tensor.data
        ):
            self.data_of[id(out)] = self.data_of.get(id(args[0]), id(args[0]))
            self.keep.append(out)
        # torch.nn.init's functions pass their tensor as tensor=, Tensor methods as the first argument
        target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        if (
            name.endswith("_")
            and not name.startswith("__")
            and name not in _ARITHMETIC
            and isinstance(target, torch.Tensor)
        ):
            self.ids.add(self.data_of.get(id(target), id(target)))
        return out


def build_random_hf(cls: type, config: Any, whole: bool) -> nn.Module | None:
    """`cls(config)` randomly initialised as this module says: parameters on the meta device with an
    init_parameter for the engine (`whole=False`), or every parameter drawn (`whole=True`). None when the
    model's `_init_weights` cannot initialise it this way."""
    model = empty_hf_model(cls, config)
    init = RandomInit(model, int(torch.randint(0, 2**62, ()).item()))  # one draw, as every build makes
    if init.undrawn() is not None:
        return None
    if whole:
        # Every value drawn first, the model still all on meta, as each is drawn for the engine: a draw's calls
        # on a parent's _init_weights would redraw, in place, any parameter already put back real.
        values: dict[int, nn.Parameter] = {}
        draws: dict[str, dict[str, torch.Tensor]] = {}  # a module's parameters are drawn together, once
        places = []
        for name, p in model.named_parameters(remove_duplicate=False):
            owner, _, kind = init.canonical[name].rpartition(".")
            if id(p) not in values:
                drawn = draws[owner] if owner in draws else draws.setdefault(owner, init.draw(owner))
                values[id(p)] = nn.Parameter(drawn[kind].detach(), requires_grad=p.requires_grad)
            places.append((name, id(p)))
        for name, key in places:
            parent, _, attr = name.rpartition(".")
            model.get_submodule(parent)._parameters[attr] = values[key]
    else:
        model.init_parameter = init  # an instance attribute: the engine looks for it on the model
    return model


def initialisable(cls: type, config: Any) -> bool:
    """Whether build_random_hf can build this model (checked on its meta-device structure)."""
    return RandomInit(empty_hf_model(cls, config), 0).undrawn() is None
