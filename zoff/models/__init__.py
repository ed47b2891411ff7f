"""Model registry: `build_model(model_cfg)` for builtin names, `hf:<ClassName>` transformers models and
`python:pkg.module:factory` user factories."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zoff.config import ModelConfig
from zoff.errors import UserError
from zoff.models.gpt import GPT

BUILTIN = ("gpt",)


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32; accepts raw logits or an output object with `.logits` (HF models)."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------- what each model family answers, once
def builds_sharded(cfg: ModelConfig) -> bool:
    """The builtin GPT, hf: models with a model.path of safetensors weights, and hf: models randomly
    initialised (no path) are built on the meta device and materialised shard by shard by the engine (each
    rank draws or reads only what it owns; hf.loads_shards has the exceptions); other families are built
    whole, in fp32, on every rank first."""
    if cfg.name == "gpt":
        return True
    if cfg.name.startswith("hf:"):
        from zoff.models.hf import loads_shards

        return loads_shards(cfg)
    return False


def build_for_engine(cfg: ModelConfig) -> nn.Module:
    """The model as the trainer hands it to the engine: deferred (parameters on meta, materialised by the
    engine from init_parameter) where builds_sharded says so, else built whole; with model.lora, adapted
    (the adapters are injected on the meta device too, and drawn by the engine like the rest)."""
    hf = cfg.name.startswith("hf:")
    # An hf: random init finds while building (hf_init) whether it can be drawn by shard; a model.path with
    # safetensors gets real buffers and parameters read from the files.
    if hf and (cfg.path is None or builds_sharded(cfg)):
        from zoff.models.hf import build_hf_model

        return _adapted(build_hf_model(cfg, shard_only=True), cfg)
    return meta_model(cfg) if builds_sharded(cfg) else build_model(cfg)


def _adapted(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    if not cfg.lora.enabled:
        return model
    from zoff.models.lora import apply_lora  # peft is optional

    return apply_lora(model, cfg.lora)


def checks_vocab(cfg: ModelConfig) -> bool:
    """The trainer checks the corpus's token ids against model.vocab_size; hf: models check their own
    embedding size, and factories are the user's."""
    return cfg.name == "gpt"


def has_analytic_activations(cfg: ModelConfig) -> bool:
    """The GPT's saved activations follow a formula (planning/activations.py); others are probed."""
    return cfg.name == "gpt"


def flops_per_token(n_params: int, n_layer: int = 0, d_model: int = 0, seq_len: int = 0) -> float:
    """Training FLOPs per token: 6N for the matmuls forward and backward, plus 12 L d T for attention (PaLM)."""
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def model_flops_per_token(model: nn.Module, cfg: ModelConfig, seq_len: int) -> float:
    """flops_per_token for a built (or meta) model: depth and width from its own config where it has one."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    hf = getattr(model, "config", None)  # transformers models name them differently from ModelConfig
    layers = getattr(hf, "num_hidden_layers", None) or cfg.n_layer
    width = getattr(hf, "hidden_size", None) or cfg.d_model
    return flops_per_token(n, layers, width, seq_len)


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the model a config section names (with model.lora, adapted). Use `with torch.device("meta"):` to
    build without memory."""
    return _adapted(_build_base(cfg), cfg)


def _build_base(cfg: ModelConfig) -> nn.Module:
    if cfg.name == "gpt":
        return GPT(
            cfg.n_layer, cfg.n_head, cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.dropout, cfg.tie_embeddings,
            cfg.positions, cfg.rope_theta,
        )  # fmt: skip
    if cfg.name.startswith("python:"):
        return _from_factory(cfg)
    if cfg.name.startswith("hf:"):
        from zoff.models.hf import build_hf_model  # transformers is optional and slow to import

        return build_hf_model(cfg)
    raise UserError(
        f"model.name: unknown model '{cfg.name}' (expected one of {', '.join(BUILTIN)}, hf:ClassName or python:pkg.mod:fn)"
    )


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The configured model with shapes only (meta device): a 70B config costs nothing."""
    with torch.device("meta"):
        return build_model(cfg)


def enable_activation_checkpointing(model: nn.Module, checkpoint_fn: Callable | None = None) -> None:
    """Switch on activation checkpointing: builtin and factory models by their `activation_checkpointing`
    attribute, transformers models by their own switch, non-reentrant (what stage 3's gathering and the
    reduction of gradients that fire twice are tested with). A model with neither is an error.

    checkpoint_fn: what runs each checkpointed block in place of torch's checkpoint (train.activation_offload's):
    the builtin GPT's `checkpoint_fn`, a transformers layer's `_gradient_checkpointing_func`."""
    if isinstance(getattr(model, "activation_checkpointing", None), bool):
        model.activation_checkpointing = True
        if checkpoint_fn is not None:
            if not hasattr(model, "checkpoint_fn"):
                raise UserError(
                    f"train.activation_offload: {type(model).__name__} has no `checkpoint_fn` attribute that its "
                    "forward calls for each checkpointed block (the builtin GPT's); set the key to false"
                )
            model.checkpoint_fn = checkpoint_fn
        return
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise UserError(
            f"train.activation_checkpointing: {type(model).__name__} has no switch for it (give the module a "
            "bool attribute `activation_checkpointing` that its forward honours, or set the key to false)"
        )
    if checkpoint_fn is not None:
        layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
        if not layers:
            raise UserError(
                f"train.activation_offload: {type(model).__name__}'s layers have no _gradient_checkpointing_func "
                "to run through zoff's offloading checkpoint; set the key to false"
            )
        for m in layers:
            m._gradient_checkpointing_func = checkpoint_fn


def _from_factory(cfg: ModelConfig) -> nn.Module:
    spec = cfg.name[len("python:") :]
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise UserError(f"model.name: '{cfg.name}' should look like python:pkg.module:factory")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"model.name: cannot import module '{mod_name}': {e}") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise UserError(f"model.name: '{mod_name}' has no callable '{fn_name}'")
    model = factory(cfg)
    if not isinstance(model, nn.Module):
        raise UserError(f"model.name: {spec} returned {type(model).__name__}, expected a torch.nn.Module")
    return model
