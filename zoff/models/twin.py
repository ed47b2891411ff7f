"""Tiny twins: a model's class built at toy sizes, to try what a model does rather than assume it (whether it
keeps packed examples apart, whether its logits are its head's output). Each verdict is cached per question,
class, transformers and torch version (zoff's cache folder), so a run pays for a try once (well under a
second)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zoff.host.cache import cache_dir

PROBE_VERSION = 1  # bump when a try changes what it checks: older verdicts are then not reused

SHRUNK = {  # the sizes a tiny twin gets, for the config names transformers' families use
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 64,
    "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "d_model": 32, "num_layers": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str  # when not: what the try saw


def base_of(model: nn.Module) -> nn.Module:
    """The model itself, or the one a peft wrapper holds."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cached_verdict(question: str, model: nn.Module, attempt: Callable[[nn.Module], Verdict]) -> Verdict:
    """`attempt` on a tiny twin of `model`, cached under (question, class, the twin's whole config, versions):
    two models of one class whose configs differ (a logit scale, an attention kind) are tried apart. Only a
    verdict the try reached is cached, never a twin that could not be built."""
    base = base_of(model)
    twin = tiny_twin(base)
    if twin is None:
        return Verdict(False, "no tiny instance of it can be built to try")
    key = f"{question}|v{PROBE_VERSION}|{_key(type(base))}|{_config_digest(twin)}"
    cached = _read_cache().get(key)
    if isinstance(cached, dict) and isinstance(cached.get("ok"), bool):
        return Verdict(cached["ok"], str(cached.get("why", "")))
    verdict = attempt(twin)
    _write_cache(key, verdict)
    return verdict


def _config_digest(twin: nn.Module) -> str:
    """A digest of everything the twin was built from: its transformers config (attention kind included),
    or for the builtin GPT its class alone (its twin's arguments are fixed)."""
    config = getattr(twin, "config", None)
    if config is None:
        return "fixed"
    text = config.to_json_string(use_diff=False) + str(getattr(config, "_attn_implementation", ""))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    kinds = getattr(small, "layer_types", None)  # per-layer kinds (sliding/full attention) follow the depth
    if isinstance(kinds, list) and kinds:
        small.layer_types = [kinds[i % len(kinds)] for i in range(SHRUNK["num_hidden_layers"])]
    small.use_cache = False
    try:
        with torch.device("cpu"):
            return type(model)._from_config(small, dtype=torch.float32)
    except Exception:  # noqa: BLE001 - a config whose sizes depend on each other in ways SHRUNK breaks
        return None


def vocab_of(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    return emb.num_embeddings


def output_tensor(out: object) -> torch.Tensor:
    """A model's output as one tensor: itself, .logits, .last_hidden_state or its first element."""
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
    return cache_dir() / "model-verdicts.json"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, verdict: Verdict) -> None:
    """Best effort: a cache that cannot be written costs only the try again."""
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_cache(), key: {"ok": verdict.ok, "why": verdict.why}}
        tmp = path.with_name(f".model-verdicts-{os.getpid()}.json")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
