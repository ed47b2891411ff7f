"""Hugging Face transformers models: `model.name: hf:<ClassName>`, from `model.config` or a local `model.path`.

From config (random init): the transformers config class gets zoff's generic model keys (vocab_size,
hidden_size <- d_model, num_hidden_layers <- n_layer, num_attention_heads <- n_head, max_position_embeddings <-
seq_len, tie_word_embeddings, every dropout <- dropout, intermediate_size <- 4 d_model), and `model.config`
sets or overrides any key of that class. From `model.path`: the directory's config.json, with `model.config`
on top, and its weights. transformers is an optional extra (`pip install zoff[hf]`).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoff.config import ModelConfig
from zoff.config.schema import suggest
from zoff.errors import UserError
from zoff.files.hub import model_folder

PREFIX = "hf:"
DROPOUT_KEYS = (
    "dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout",
)  # fmt: skip
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Accepted by every config class's constructor without being attributes of the same name.
EXTRA_KWARGS = {"attn_implementation", "dtype", "torch_dtype"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError("model.name: hf: models need transformers: pip install zoff[hf]") from None
    return transformers


def model_class(cfg: ModelConfig) -> type:
    """The transformers class `hf:<ClassName>` names (an Auto* class is resolved later, from the config)."""
    transformers = _transformers()
    name = cfg.name[len(PREFIX) :]
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not isinstance(cls, type):
        hint = suggest(name, [n for n in dir(transformers) if n.endswith(("LM", "Model")) or "For" in n])
        raise UserError(f"model.name: transformers has no model class '{name}'{hint}")
    if not hasattr(cls, "from_pretrained"):
        raise UserError(f"model.name: transformers.{name} is not a model class")
    return cls


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config object for this section (no weights are touched)."""
    transformers = _transformers()
    cls = model_class(cfg)
    user = dict(cfg.config)
    if cfg.path is not None:
        path = model_folder(cfg)
        if not (path / "config.json").is_file():
            raise UserError(
                f"model.path: {path} has no config.json (expected a Hugging Face model directory)"
            )
        _check_custom_code(path, user)
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, **user)
        except (OSError, ValueError) as e:
            raise UserError(f"model.path: cannot read {path / 'config.json'}: {e}") from None
        want = getattr(getattr(cls, "config_class", None), "model_type", None)
        if want and config.model_type != want:
            raise UserError(f"model.path: {path} holds a '{config.model_type}' model, not {cls.__name__}")
        if "use_cache" not in user:
            # Training never reuses keys and values; and with a cache, transformers ignores the position_ids
            # that keep packed examples apart (masking_utils). Exports switch it back on (save_hf_config).
            config.use_cache = False
        return config
    config_cls = getattr(cls, "config_class", None)
    if config_cls is None:  # an Auto* class: the model type comes from model.config
        if "model_type" not in user:
            raise UserError(f"model.config.model_type: needed to build {cls.__name__} from a config")
        config_cls = transformers.AutoConfig.for_model(user.pop("model_type")).__class__
    _check_keys(config_cls, user)
    kwargs = {**_generic(cfg, config_cls, user), **user}
    default = config_cls()
    vocab = kwargs.get("vocab_size", getattr(default, "vocab_size", None))
    for key in SPECIAL_IDS:  # defaults from big-vocabulary models would point past a small vocabulary
        tid = getattr(default, key, None)
        if key not in user and isinstance(tid, int) and isinstance(vocab, int) and tid >= vocab:
            kwargs[key] = None
    return config_cls(**kwargs)


def _generic(cfg: ModelConfig, config_cls: type, user: dict) -> dict:
    """zoff's model keys in the config class's vocabulary, for the keys model.config does not set."""
    default = config_cls()
    aliases = getattr(config_cls, "attribute_map", {}) or {}
    taken = set(user) | {aliases.get(k, k) for k in user} | {k for k, v in aliases.items() if v in user}
    out = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "max_position_embeddings": cfg.seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": False,  # training never reuses keys and values: the cache would only hold memory
    }
    if hasattr(default, "intermediate_size"):
        out["intermediate_size"] = 4 * cfg.d_model
    out.update({k: cfg.dropout for k in DROPOUT_KEYS if hasattr(default, k)})
    return {k: v for k, v in out.items() if k not in taken and (hasattr(default, k) or k in aliases)}


def _check_keys(config_cls: type, user: dict) -> None:
    """transformers configs swallow unknown keys silently; a typo should be an error instead."""
    default = config_cls()
    known = set(inspect.signature(config_cls.__init__).parameters) | EXTRA_KWARGS
    known |= set(getattr(config_cls, "attribute_map", {}) or {})
    for key in user:
        if key not in known and not hasattr(default, key):
            hint = suggest(key, sorted(known | set(default.to_dict())), "model.config")
            raise UserError(f"model.config.{key}: not a {config_cls.__name__} setting{hint}")


def concrete_class(cfg: ModelConfig, config: Any) -> type:
    """The class `hf:<ClassName>` builds for this config: an Auto* class resolved to the config's model class
    (from the folder's own code when its config asks for it and the user opted in)."""
    cls = model_class(cfg)
    if getattr(cls, "config_class", None) is not None:
        return cls
    auto_map = getattr(config, "auto_map", None) or {}
    if cfg.path is not None and cls.__name__ in auto_map and cfg.config.get("trust_remote_code"):
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map[cls.__name__], str(model_folder(cfg)))
    try:
        return cls._model_mapping[type(config)]
    except KeyError:
        raise UserError(f"model.name: {cls.__name__} has no class for '{config.model_type}' models") from None


def loads_shards(cfg: ModelConfig) -> bool:
    """Whether this hf: section is built shard by shard: a model.path with safetensors weights of a class whose
    checkpoints need no tensor conversions (hf_shards.shard_loadable), or no path and a model whose
    `_init_weights` initialises every parameter module by module (hf_init.py)."""
    from zoff.models.hf_init import initialisable
    from zoff.models.hf_shards import shard_loadable
    from zoff.models.safetensors_reader import has_safetensors

    if cfg.path is not None and not has_safetensors(model_folder(cfg)):
        return False
    config = hf_config(cfg)
    cls = concrete_class(cfg, config)
    return initialisable(cls, config) if cfg.path is None else shard_loadable(cls, config)


def build_hf_model(cfg: ModelConfig, shard_only: bool = False) -> nn.Module:
    """Random init from the config, or the weights of model.path; on a meta device only the structure.

    `shard_only`: parameters stay on the meta device and the engine reads each rank's share of them from
    model.path's safetensors files (hf_shards.py; loads_shards(cfg) must hold), or draws it (no path:
    hf_init.py, where it can; else transformers builds the model whole). A random init without shard_only
    draws the same values whole."""
    from zoff.models.hf_init import build_random_hf

    config = hf_config(cfg)
    cls = concrete_class(cfg, config)
    on_meta = torch.empty(0).device.type == "meta"
    if shard_only and cfg.path is not None:
        from zoff.models.hf_shards import build_deferred_hf

        model = build_deferred_hf(cls, config, model_folder(cfg))
    elif on_meta and not shard_only:  # the structure alone
        model = cls._from_config(config, dtype=torch.get_default_dtype())
    elif cfg.path is None:
        model = build_random_hf(cls, config, whole=not shard_only)
        if model is None:  # a model hf_init cannot draw module by module: transformers' own init, whole
            model = cls._from_config(config, dtype=torch.get_default_dtype())
    else:
        try:
            model = cls.from_pretrained(
                str(model_folder(cfg)), config=config, local_files_only=True, dtype=torch.float32
            )
        except (OSError, ValueError) as e:
            raise UserError(
                f"model.path: cannot load weights from {cfg.path}: {str(e).splitlines()[0]}"
            ) from None
    model.train()  # from_pretrained returns eval mode; zoff's trainer switches modes itself
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "num_embeddings"):
        model.register_forward_pre_hook(_IdGuard(emb.num_embeddings))
    return model


def _check_custom_code(path: Path, user: dict) -> None:
    """A config.json whose model type transformers does not know names its own Python code (auto_map), which
    would run on every rank: only when the user says so (model.config.trust_remote_code: true, the keyword
    transformers itself takes)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: cannot read {path / 'config.json'}: {e}") from None
    if not isinstance(raw, dict) or not raw.get("auto_map") or user.get("trust_remote_code"):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw.get("model_type") in CONFIG_MAPPING:  # transformers' own class, as from_pretrained would use
        return
    classes = ", ".join(f"{k}={v}" for k, v in raw["auto_map"].items())
    raise UserError(
        f"model.path: {path / 'config.json'} needs custom code from the folder ({classes}); "
        "zoff runs it only with model.config.trust_remote_code: true"
    )


class _IdGuard:
    """A token id past the embedding table is a tokenizer/vocabulary mismatch: name it, not an IndexError."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, module: nn.Module, args: tuple) -> None:
        ids = args[0] if args else None
        if (
            isinstance(ids, torch.Tensor)
            and ids.numel()
            and not ids.is_floating_point()
            and ids.device.type != "meta"  # zoff estimate's activation probe runs on meta tensors
        ):
            top = int(ids.max())
            if top >= self.vocab:
                raise UserError(
                    f"data.tokenizer: token id {top} does not fit the model's vocabulary of {self.vocab} "
                    "(raise model.vocab_size or model.config.vocab_size, or use a smaller tokenizer)"
                )


def save_hf_config(
    cfg: ModelConfig, out: Path, dtype: torch.dtype, eos_id: int | None, stored: dict | None = None
) -> None:
    """config.json for an exported model: the training config, its class as architecture, the export dtype.

    `stored`: the config.json a checkpoint carries (exported_files), used as it is but for the same edits;
    without it the config is rebuilt from the run's config (and model.path's config.json)."""
    if stored is not None:
        data = {k: v for k, v in stored.items() if k != "torch_dtype"}  # the old name of dtype
        data["use_cache"] = True  # inference wants the cache that training switched off
        data["dtype"] = str(dtype).removeprefix("torch.")
        if eos_id is not None and isinstance(data.get("vocab_size"), int) and eos_id < data["vocab_size"]:
            data["eos_token_id"] = eos_id
        (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    config = hf_config(cfg)
    cls = concrete_class(cfg, config)
    config.architectures = [cls.__name__]
    config.use_cache = True  # inference wants the cache that training switched off
    config.dtype = dtype
    if eos_id is not None and eos_id < config.vocab_size:
        config.eos_token_id = eos_id
    config.save_pretrained(str(out))
    json.loads((out / "config.json").read_text())  # fail here, not in from_pretrained, if it is not JSON


def exported_files(model: nn.Module) -> dict[str, str]:
    """What a checkpoint stores beside a transformers model's tensors so that `zoff convert --format hf` needs
    nothing from the original model folder: its config.json (with its class as architecture) and, when it
    has one, its generation_config.json. Empty for other models."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_dict", None)) or not hasattr(config, "model_type"):
        return {}
    data = config.to_dict()
    data["architectures"] = [type(model).__name__]
    files = {"config.json": json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"}
    generation = getattr(model, "generation_config", None)
    if callable(getattr(generation, "to_json_string", None)):
        files["generation_config.json"] = generation.to_json_string()
    return files
