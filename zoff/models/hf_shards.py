"""Shard-only loading of a Hugging Face model folder: no rank ever holds the whole model.

`build_deferred_hf` builds the transformers model with its parameters on the meta device and its buffers real
(rotary tables and the like are computed by the constructor, and persistent buffers stored in the folder are
read over them), and gives it `init_parameter(name, out)`. The engine's deferred path (engine/materialize.py)
calls that only for the parameters that overlap the rank's shards, and `_ShardLoader` then reads exactly those
tensors' byte ranges from the safetensors files into the engine's buffers, converting dtype on the way.

Names: a checkpoint key becomes a model name the way `from_pretrained` renames it (transformers' own renaming
rules, then the base-model prefix added or stripped), so a folder saved from the bare base model or from the
head model loads either way. Tied parameters (an lm_head tied to the embeddings) are one Parameter under
several names; whichever of the names the folder stores is read. Models whose checkpoints need transformers'
tensor conversions (fused MoE experts and such: several stored tensors make one parameter) are not loaded
here: `shard_loadable` says no, and the trainer loads them whole with from_pretrained as before.

Every parameter is resolved (present, same number of elements) when the model is built, the same way on
every rank: a missing tensor is an error before any collective starts, never one rank failing in the middle
of materialisation while the others wait in an all-gather.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoff.errors import UserError
from zoff.models.safetensors_reader import INDEX, SINGLE, WeightFiles


def shard_loadable(cls: type, config: Any) -> bool:
    """Whether checkpoints of this class load tensor by tensor, by renaming alone (no fused conversions)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without conversion rules converts nothing
        return True
    names = {cls.__name__, getattr(config, "model_type", "")}
    for key in getattr(config, "sub_configs", {}) or {}:
        names.add(getattr(getattr(config, key, None), "model_type", ""))
    for name in filter(None, names):
        rules = get_checkpoint_conversion_mapping(name) or []
        if any(not isinstance(r, WeightRenaming) for r in rules):
            return False
    return True


def empty_hf_model(cls: type, config: Any) -> nn.Module:
    """`cls(config)` with parameters on the meta device (tied as the model ties them) and buffers real."""
    from accelerate import init_empty_weights

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: their random init runs on meta tensors, costing only time
        from contextlib import nullcontext as no_init_weights
    # cpu: a caller under `with torch.device("meta")` would put the buffers there too. include_buffers=False
    # keeps buffers real; no_init_weights skips transformers' random init of parameters filled later.
    with torch.device("cpu"), init_empty_weights(include_buffers=False), no_init_weights():
        model = cls._from_config(config, dtype=torch.float32)
    model.tie_weights()  # no_init_weights skips post_init's tying; from_pretrained ties after loading too
    return model


def build_deferred_hf(cls: type, config: Any, folder: Path) -> nn.Module:
    """`cls(config)` with parameters on meta, real buffers, and an init_parameter reading `folder`'s files."""
    files = WeightFiles(folder)
    model = empty_hf_model(cls, config)
    loader = _ShardLoader(model, files)
    loader.load_buffers(model)
    # An instance attribute, not a method: the engine looks for `init_parameter` on the model it is given.
    model.init_parameter = loader
    _generation_config(model, folder)
    return model


class _ShardLoader:
    """init_parameter for a deferred transformers model: parameter name -> its tensor in the folder's files."""

    def __init__(self, model: nn.Module, files: WeightFiles):
        self.files = files
        where = files.folder / (INDEX if (files.folder / INDEX).is_file() else SINGLE)
        self.source = _checkpoint_names(model, files)  # model state_dict name -> checkpoint key
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self.key: dict[str, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            key = next((self.source[n] for n in aliases[id(p)] if n in self.source), None)
            if key is None:
                also = [n for n in aliases[id(p)] if n != name]
                tied = f" (nor its tied name{'s' if len(also) > 1 else ''} {', '.join(also)})" if also else ""
                raise UserError(f"model.path: {where} has no tensor for parameter '{name}'{tied}")
            if math.prod(files.shape(key)) != p.numel():
                raise UserError(
                    f"model.path: {files.file_of(key)}: tensor '{key}' has shape {files.shape(key)}, "
                    f"parameter '{name}' of the model has {list(p.shape)}"
                )
            self.key[name] = key

    @torch.no_grad()
    def __call__(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` with parameter `name`'s stored value (whatever out's dtype: converted on the way)."""
        if name not in self.key:
            raise KeyError(f"'{name}' is not a parameter of this model")
        self.files.read_into(self.key[name], out)

    @torch.no_grad()
    def load_buffers(self, model: nn.Module) -> None:
        """Persistent buffers stored in the folder replace the constructor's values, as from_pretrained does;
        the others (not in any file: recomputed tables) keep what the constructor computed."""
        persistent = set(model.state_dict(keep_vars=True))
        for name, buf in model.named_buffers():
            key = self.source.get(name)
            if name not in persistent or key is None:
                continue
            if math.prod(self.files.shape(key)) != buf.numel():
                raise UserError(
                    f"model.path: {self.files.file_of(key)}: buffer '{key}' has shape "
                    f"{self.files.shape(key)}, the model's '{name}' has {list(buf.shape)}"
                )
            self.files.read_into(key, buf)


def _checkpoint_names(model: nn.Module, files: WeightFiles) -> dict[str, str]:
    """model state_dict name -> checkpoint key, renaming each checkpoint key the way from_pretrained does."""
    names = {n: True for n in model.state_dict(keep_vars=True)}  # values only tested for `is not None`
    prefix = getattr(model, "base_model_prefix", "") or None
    rename = _transformers_renamer(model, names, prefix)
    out: dict[str, str] = {}
    for key in sorted(files.keys()):
        target = rename(key)
        if target in names:
            out.setdefault(target, key)
    return out


def _transformers_renamer(model: nn.Module, names: dict, prefix: str | None):
    """transformers' own key renaming (legacy names, registered renames, the base-model prefix) where this
    version has it; otherwise the base-model prefix alone, added or stripped."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
    except (ImportError, TypeError, AttributeError):
        return lambda key: _prefixed(key, names, prefix)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        target, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if target not in names and key in names:  # what from_pretrained does: the key may need no renaming
            target, pattern = rename_source_key(key, [], [], prefix, names)
        if pattern is not None:  # shard_loadable keeps such models away; a folder could still surprise
            raise UserError(
                f"model.path: tensor '{key}' needs transformers' conversion '{pattern}' to load; "
                "shard-only loading reads tensors as they are stored"
            )
        return target

    return rename


def _prefixed(key: str, names: dict, prefix: str | None) -> str:
    if key in names or not prefix:
        return key
    stripped = re.sub(f"^{re.escape(prefix)}\\.", "", key, count=1)
    if stripped in names:
        return stripped
    return f"{prefix}.{key}"


def _generation_config(model: nn.Module, folder: Path) -> None:
    """generation_config.json travels with the model, as from_pretrained loads it (checkpoints carry it)."""
    if not (folder / "generation_config.json").is_file() or not hasattr(model, "generation_config"):
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: cannot read {folder / 'generation_config.json'}: {e}") from None
