"""train.sequence_parallel for transformers' causal LMs: zoff registers its Ulysses attention (ulysses.py) as an
attention implementation and switches the model to it. Only model types whose every token-mixing layer goes
through transformers' attention interface are split, and of those only what the exchange reproduces exactly:
sliding windows (taken from the config, as the model's own mask builder takes them, since not every model
passes its window to the attention function) and static rotary embeddings. Rotary embeddings whose frequencies
follow the longest position a call sees (`dynamic`, `longrope`) would differ between the ranks' shards and are
refused, as are soft-caps and sink logits."""

from __future__ import annotations

import functools

from torch import nn

from zoff.errors import UserError
from zoff.models.ulysses import KEY, SequenceGroup, check_heads, eager_attention

HF_NAME = "zoff_ulysses"  # the attention implementation this module registers
# transformers model types whose every token-mixing layer is attention through the attention interface (no
# linear-attention layers, no soft-cap, no sink logits): the rest are refused by name rather than trained with
# attention that silently sees only the rank's own tokens.
HF_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
# rotary scalings computed from the positions of the call (transformers' dynamic_rope_update): a shard's
# largest position is not the sequence's
SHARD_DEPENDENT_ROPE = ("dynamic", "longrope")


def hf_splittable(base: nn.Module, n: int):
    """The model's config, or one line naming the key where it cannot be split over `n` ranks."""
    config = getattr(base, "config", None)
    name = type(base).__name__
    if getattr(config, "model_type", None) not in HF_MODEL_TYPES:
        raise UserError(
            f"{KEY}: {name} cannot be split over ranks (zoff splits the builtin GPT and transformers' "
            f"{', '.join(HF_MODEL_TYPES)} models: their every layer attends through transformers' attention "
            "interface); set the key to 1"
        )
    shard_dependent = _rope_types(config) & set(SHARD_DEPENDENT_ROPE)
    if shard_dependent:
        raise UserError(
            f"{KEY}: {name}'s rotary embedding ({', '.join(sorted(shard_dependent))}) scales with the longest "
            "position each call sees, which differs between the ranks' shards; set the key to 1"
        )
    heads = config.num_attention_heads
    check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, n, name)
    return config


def _rope_types(config) -> set[str]:
    """The rope_type of every rotary embedding the config describes (one, or one per layer type)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return set()
    each = (
        [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    )
    return {str(r.get("rope_type", r.get("type"))) for r in each}


def split_hf(base: nn.Module, sg: SequenceGroup) -> list[nn.Module]:
    """Switch `base` to zoff's Ulysses attention; returns its attention modules (each forward's check)."""
    from transformers import AttentionInterface

    hf_splittable(base, sg.size)
    AttentionInterface.register(HF_NAME, functools.partial(_hf_attention, sg, eager_attention()))
    base.set_attn_implementation(HF_NAME)
    layers = [m for m in base.modules() if type(m).__name__.endswith("Attention")]
    if base.config._attn_implementation != HF_NAME or not layers:
        raise UserError(f"{KEY}: {type(base).__name__} does not take transformers' attention implementations")
    return layers


def layer_window(module: nn.Module) -> int | None:
    """The sliding window of `module`'s layer as the model's mask builder applies it: per layer where the config
    has layer_types (Qwen2, Qwen2-MoE: some layers slide), else the config's sliding_window (Mistral, Mixtral)."""
    config = module.config
    types = getattr(config, "layer_types", None)
    if types is not None:
        return config.sliding_window if types[module.layer_idx] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def _hf_attention(
    sg: SequenceGroup, attend, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw
):
    """transformers' attention interface: (b, H, s/N, d) states of this rank's tokens -> ((b, s/N, H, d), None).
    The model builds no mask for an implementation it does not know: positions make it here."""
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if kw.get("softcap") is not None or kw.get("s_aux") is not None:
        raise UserError(f"{KEY}: {where} uses a soft-cap or sink logits, which zoff cannot split")
    window, passed = layer_window(module), kw.get("sliding_window")
    if passed is not None and passed != window:
        raise RuntimeError(f"{KEY}: {where} attends within a window of {passed}, its config says {window}")
    position_ids = kw.get("position_ids")
    if position_ids is None:
        raise RuntimeError(f"{KEY}: {where} was called without position_ids")
    y = attend(query, key, value, position_ids, sg, dropout, scaling, window=window, layer=id(module))
    return y.transpose(1, 2), None
