"""A LoRA checkpoint out of zoff: its adapters as peft's own adapter folder (`zoff convert --format peft`), or
merged into the base weights (`--merge`).

`--format peft` builds the run's base on the meta device, wraps it with peft's `get_peft_model` under the
run's LoraConfig, and has peft's own `save_pretrained` write adapter_config.json, adapter_model.safetensors
(and its model card) from the checkpoint's adapter values: the files are peft's by construction, so
`PeftModel.from_pretrained` loads them. peft writes the adapters from one dict, so they are held at once: a
fraction of a percent of the model for the usual ranks, and never the base.

`--merge` gives every adapted layer's base weight W + (alpha / r) B A through peft's own `LoraLayer.merge`,
run on that layer's tensors alone (transformers' Conv1D and its transposed layout are peft's concern, as in
`merge_and_unload`), one layer at a time: the memory bound stays about one weight.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from zoff.config import LoraConfig, ModelConfig
from zoff.errors import UserError
from zoff.models.lora import ADAPTER, BASE_LAYER, base_name, is_adapter


class TensorSource(Protocol):
    """What convert reads tensors through (convert._Source): every state_dict key's shape, dtype and value,
    and the names a tied tensor goes by (the first one is where a Hugging Face folder stores it)."""

    keys: list[str]

    def meta(self, key: str) -> tuple[list[int], torch.dtype]: ...

    def tensor(self, key: str) -> torch.Tensor: ...

    def names(self, key: str) -> list[str]: ...


def write_peft_folder(
    src: TensorSource, model_cfg: ModelConfig, tmp: Path, out: Path, dtype: torch.dtype, base_path: str | None
) -> list[Path]:
    """Write the adapters of `src` into the folder `tmp` as peft's save_pretrained does; returns the files
    under their final folder `out`. `model_cfg` builds the run's structure (meta device, nothing read);
    `base_path`, the base folder the adapters apply to, goes to adapter_config.json's base_model_name_or_path."""
    import peft

    from zoff.models import meta_model

    with torch.device("meta"), warnings.catch_warnings():
        # peft's and transformers' notes on building (Conv1D gets fan_in_fan_out, deprecations) say nothing
        # about the export: the same model was built, with the same notes, for training
        warnings.simplefilter("ignore")
        adapted = meta_model(model_cfg)
        config = copy.deepcopy(adapted.zoff_lora_config)  # target_modules as the run resolved them
        base = meta_model(dataclasses.replace(model_cfg, lora=LoraConfig()))
        config.base_model_name_or_path = base_path
        config.task_type = _task_type(base)  # None: peft records the base's class (auto_mapping) instead
        wrapped = peft.get_peft_model(base, config)
    # zoff's adapted model is the model peft wraps: its names sit under the wrapped base model's module name
    prefix = next(n for n, m in wrapped.named_modules() if m is wrapped.get_base_model()) + "."
    names = [k for k in src.keys if is_adapter(k)]
    state = {prefix + k: src.tensor(k).to(dtype) for k in names}
    unknown = sorted(set(state) - set(wrapped.state_dict()))
    if unknown:  # zoff's injection and peft's disagree: a bug, not a user error
        raise RuntimeError(f"peft's model has no parameter '{unknown[0]}' for zoff's adapter")
    # zoff never resizes the vocabulary, and the base's embeddings are in the base folder: peft's "auto" would
    # look the base up (on the Hub when the folder is gone) only to decide that
    wrapped.save_pretrained(str(tmp), state_dict=state, save_embedding_layers=False)
    return [out / f.name for f in sorted(tmp.iterdir())]


def _task_type(model: nn.Module) -> str | None:
    """CAUSAL_LM for transformers' causal language models (PeftModelForCausalLM then loads the folder)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return "CAUSAL_LM" if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else None


class MergedSource:
    """`src` with the adapters merged into their base weights, under the unadapted model's names (no
    base_layer, no lora keys). `model`: the run's adapted model (its LoRA layers do the merging; parameters
    may be on the meta device: each layer is filled with the checkpoint's values only while it merges).
    `aliases`: the model's tied names (convert.tied_names; a checkpoint may hold a tied weight under each name),
    passed in so that this module never imports convert, which imports it."""

    def __init__(self, src: TensorSource, model: nn.Module, aliases: dict[str, list[str]]):
        from peft.tuners.lora import LoraLayer

        self.src = src
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
        self.source = {base_name(k): k for k in src.keys if not is_adapter(k)}
        self.keys = list(self.source)
        for name in self.layers:
            key = f"{name}{BASE_LAYER}weight"
            # merging would change the weight under its other names too (an lm_head tied to the embeddings)
            tied = [n for n in aliases.get(key, []) if n != key]
            if tied:
                raise UserError(
                    f"--merge: the adapted weight '{base_name(key)}' is tied to '{base_name(tied[0])}', which "
                    "its adapter does not change; export the adapters with --format peft instead"
                )

    def meta(self, key: str) -> tuple[list[int], torch.dtype]:
        return self.src.meta(self.source[key])

    def names(self, key: str) -> list[str]:
        return [base_name(n) for n in self.src.names(self.source[key])]

    def tensor(self, key: str) -> torch.Tensor:
        original = self.source[key]
        layer, _, param = original.rpartition(BASE_LAYER)
        if layer not in self.layers:
            return self.src.tensor(original)
        if param != "weight" and not getattr(self.layers[layer], "lora_bias", {}).get(ADAPTER, False):
            return self.src.tensor(original)  # a bias the merge leaves as it is: no merge to compute
        return self._merged(layer, original[len(layer) + 1 :])

    @torch.no_grad()
    def _merged(self, name: str, param: str) -> torch.Tensor:
        """Parameter `param` (base_layer.weight, or a bias a LoRA bias changes) of LoRA layer `name`, merged."""
        layer = self.layers[name]
        originals = []
        try:
            for rel, p in list(layer.named_parameters()):
                owner, _, leaf = rel.rpartition(".")
                module = layer.get_submodule(owner)
                originals.append((module, leaf, p))
                # every read is a fresh tensor (convert._Source): merging in place touches nothing else
                value = self.src.tensor(f"{name}.{rel}").to(torch.float32)
                setattr(module, leaf, nn.Parameter(value, requires_grad=False))
            layer.merge(adapter_names=[ADAPTER])
            return layer.get_parameter(param).detach()
        finally:
            for module, leaf, p in originals:
                setattr(module, leaf, p)
            layer.merged_adapters.clear()  # the structure is unmerged again for the next weight
