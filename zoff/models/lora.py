"""LoRA adapters through peft (`model.lora`): peft's LoRA layers are injected into the model zoff builds, before
the engine partitions it, so the frozen base is partitioned (and offloaded) at stage 3 like any frozen weight
and only the adapters get gradients and optimizer state.

peft's own `get_peft_model` wraps the model in a PeftModel; zoff injects the layers in place instead
(`inject_adapter_in_model`), so the model keeps its class, its blocks and its hooks, and works the same for
transformers models, the builtin GPT and user factories. The exported adapter folder is what peft writes
(checkpoint/peft_export.py), so `PeftModel.from_pretrained` loads it.

Initial values: lora_A as peft draws it (Kaiming-uniform, a = sqrt(5)), lora_B zero, so the adapted model
starts equal to its base. zoff draws each lora_A from a generator seeded by the parameter's name, so the
values are the same at any world size and stage, built whole or on the meta device and materialised shard
by shard; base parameters keep the model's own init_parameter (a model.path's stored values).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from zoff.config import LoraConfig
from zoff.errors import UserError

ADAPTER = "default"  # peft's adapter name: it appears in parameter names (".lora_A.default.weight")
BASE_LAYER = ".base_layer."  # peft moves the wrapped layer's parameters under this name


def _peft():
    try:
        import peft
    except ImportError:
        raise UserError("model.lora: LoRA needs the peft package: pip install zoff[lora]") from None
    return peft


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that maps hidden states to the vocabulary (not adapted by "all-linear", as in peft)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None else getattr(model, "lm_head", None)


def resolve_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """peft's target_modules: "all-linear" becomes the names of every Linear (and transformers' Conv1D) but
    the output head; short names where they pick exactly those modules, else full module names."""
    if targets != ["all-linear"]:
        return list(targets)
    head = output_head(model)
    linear = [
        n
        for n, m in model.named_modules()
        if n and m is not head and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    ]
    if not linear:
        raise UserError(f"model.lora.target_modules: {type(model).__name__} has no Linear module to adapt")
    short = sorted({n.rsplit(".", 1)[-1] for n in linear})
    others = [n for n, _ in model.named_modules() if n and n not in linear]
    clash = any(o.rsplit(".", 1)[-1] in short for o in others)
    return sorted(linear) if clash else short


def lora_seed() -> int:
    """The adapters' seed: from the global generator's seed (train.seed), not its state, which building the
    base consumes on real tensors but not on the meta device."""
    return (torch.initial_seed() * 1_000_003 + 0x10FA) % 2**62


class LoraInit:
    """init_parameter for an adapted model: adapters drawn by name, base parameters by the model's own."""

    def __init__(self, base: Callable[[str, torch.Tensor], None] | None, seed: int):
        self.base, self.seed = base, seed

    @torch.no_grad()
    def __call__(self, name: str, out: torch.Tensor) -> None:
        if ".lora_B." in name:
            out.zero_()
        elif ".lora_A." in name:
            fan_in = out.shape[-1]
            bound = math.sqrt(6.0 / ((1 + 5) * fan_in))  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and peft
            gen = torch.Generator().manual_seed((self.seed + zlib.crc32(name.encode())) % 2**63)
            out.copy_(torch.empty(out.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen))
        elif self.base is None:
            raise KeyError(f"'{name}': the model has no init_parameter for its base parameters")
        else:
            self.base(name.replace(BASE_LAYER, "."), out)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject LoRA layers into `model` in place (on the meta device too) and freeze everything else."""
    peft = _peft()
    targets = resolve_targets(model, cfg.target_modules)
    config = peft.LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none"
    )
    base_init = getattr(model, "init_parameter", None)
    seed = lora_seed()
    try:
        model = peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:
        raise UserError(f"model.lora.target_modules: {str(e).splitlines()[0]}") from None
    odd = next((n for n, _ in model.named_parameters() if ".lora_" in n and not is_adapter(n)), None)
    if odd is not None:  # peft's embedding and convolution adapters: other shapes, other initialisation
        raise UserError(
            f"model.lora.target_modules: '{odd.rsplit('.lora_', 1)[0]}' is not a Linear layer; zoff adapts "
            "Linear (and transformers' Conv1D) layers only"
        )
    init = LoraInit(base_init, seed)
    model.init_parameter = init  # an instance attribute: the engine looks for it on the model it is given
    model.zoff_lora_config = config  # what the adapter export writes as adapter_config.json
    for name, p in model.named_parameters():
        if p.requires_grad and not p.is_meta:
            init(name, p.data)
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_key(name: str) -> str:
    """The key peft's save_pretrained gives an adapter parameter: the adapter name dropped, under
    base_model.model (what PeftModel.from_pretrained loads)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def base_name(name: str) -> str:
    """A parameter's name in the unadapted model (peft's wrapped layers keep theirs under base_layer)."""
    return name.replace(BASE_LAYER, ".")
