"""Whether a model keeps packed examples apart, decided by what it does rather than by reading its source.

Packing puts several fine-tuning examples into one sequence, with position_ids that restart at each; the model
must then let no token attend across an example's start. Whether it does is a property of its attention code,
its mask builder and its transformers version, which no name or signature says. So a tiny instance of the
model's class (the same config with every size shrunk) runs a packed pair of examples and each example alone:
the model packs when the pair's outputs equal the lone runs'. The verdict is cached per class, transformers
and torch version (zoff's cache folder), so a run pays the probe once (well under a second)."""

from __future__ import annotations

import copy
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zoff.cache import cache_dir

SHRUNK = {  # the sizes a tiny twin gets, for the config names transformers' families use
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 64,
    "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "d_model": 32, "num_layers": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}  # fmt: skip
LENGTHS = (5, 7)  # the pair: unequal, so a mask that ignores position_ids cannot pass by symmetry


@dataclass(frozen=True)
class Verdict:
    packs: bool
    why: str  # when it does not: what the probe saw


def packs_examples(model: nn.Module) -> Verdict:
    """Whether `model` (real, meta or wrapped by peft) keeps packed examples apart; cached per class."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return Verdict(False, f"{type(base).__name__}.forward takes no position_ids")
    key = _key(type(base))
    cached = _read_cache().get(key)
    if isinstance(cached, dict) and isinstance(cached.get("packs"), bool):
        return Verdict(cached["packs"], str(cached.get("why", "")))
    twin = tiny_twin(base)
    verdict = Verdict(False, "no tiny instance of it can be built to try") if twin is None else probe(twin)
    _write_cache(key, verdict)
    return verdict


def tiny_twin(model: nn.Module) -> nn.Module | None:
    """A small instance of the model's class: the builtin GPT at tiny sizes, a transformers model from its
    config with every size shrunk; None for anything else (a factory's model cannot be rebuilt small)."""
    from zoff.models.gpt import GPT

    if isinstance(model, GPT):  # its class, so a subclass is tried as itself
        try:
            return type(model)(2, 2, 16, 64, 16)
        except TypeError:  # a subclass with other arguments
            return None
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "_from_config"):
        return None
    small = copy.deepcopy(config)
    for name, value in SHRUNK.items():
        if getattr(small, name, None) is not None:
            setattr(small, name, value)
    small.use_cache = False
    try:
        with torch.device("cpu"):
            return type(model)._from_config(small, dtype=torch.float32)
    except Exception:  # noqa: BLE001 - a config whose sizes depend on each other in ways SHRUNK breaks
        return None


@torch.no_grad()
def probe(model: nn.Module) -> Verdict:
    """Run a packed pair of examples and each example alone; equal outputs: the model keeps them apart."""
    model.eval()
    vocab = _vocab(model)
    g = torch.Generator().manual_seed(0)
    alone = [torch.randint(0, vocab, (1, n), generator=g) for n in LENGTHS]
    positions = [torch.arange(n).unsqueeze(0) for n in LENGTHS]
    try:
        packed = _outputs(model(torch.cat(alone, 1), position_ids=torch.cat(positions, 1)))
        each = [_outputs(model(x, position_ids=p)) for x, p in zip(alone, positions, strict=True)]
    except Exception as e:  # noqa: BLE001 - any failure to run packed is a model that does not pack
        return Verdict(False, f"it fails on packed input ({type(e).__name__}: {str(e)[:120]})")
    for i, (got, want) in enumerate(zip(packed.split(LENGTHS, 1), each, strict=True)):
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            where = "the second example attends to the first" if i else "the first example changes"
            return Verdict(False, f"packed, {where} (max difference {float((got - want).abs().max()):.2g})")
    return Verdict(True, "")


def _vocab(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    return emb.num_embeddings


def _outputs(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0]


def _key(cls: type) -> str:
    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = "none"
    return f"{cls.__module__}.{cls.__qualname__}|transformers {tv}|torch {torch.__version__}"


def _cache_file() -> Path:
    return cache_dir() / "packing.json"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, verdict: Verdict) -> None:
    """Best effort: a cache that cannot be written costs only the probe again."""
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_cache(), key: {"packs": verdict.packs, "why": verdict.why}}
        tmp = path.with_name(f".packing-{os.getpid()}.json")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
