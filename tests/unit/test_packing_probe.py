"""Packing is decided by behaviour (issue 36 item 5): a tiny twin of the model's class runs a packed pair of
examples against each alone; a model that keeps them apart packs, one that does not trains unpacked with one
warning (data.packing auto) or is refused (always). Verdicts are cached per class and library versions."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from zoff.config import config_from_dict
from zoff.errors import UserError
from zoff.models import packing, twin
from zoff.models.gpt import GPT
from zoff.trainer.session import packs


class Leaky(GPT):
    """Takes position_ids but lets every token see the whole sequence's past: packed examples leak."""

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx, None)


class NoPositions(torch.nn.Module):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return idx


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOFF_CACHE_DIR", str(tmp_path / "cache"))


def _cfg(packing_mode: str):
    data = {"format": "instruction", "name": "jsonl", "paths": ["x.jsonl"], "packing": packing_mode}
    return config_from_dict({"data": data})


def test_the_builtin_gpt_and_a_transformers_llama_pack() -> None:
    assert packing.packs_examples(GPT(2, 2, 16, 64, 16)).ok
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=200)
    )  # fmt: skip
    small = twin.tiny_twin(llama)
    assert type(small) is type(llama) and small.config.hidden_size == 32  # tried small, as its own class
    assert packing.packs_examples(llama).ok


def test_a_model_whose_attention_crosses_examples_does_not_pack_and_says_why() -> None:
    v = packing.packs_examples(Leaky(2, 2, 16, 64, 16))
    assert not v.ok and v.why.startswith("packed, the second example attends to the first (max difference")
    with pytest.warns(
        UserWarning, match=r"^data\.packing: auto trains Leaky one example per row: packed, the second"
    ):
        assert packs(_cfg("auto"), Leaky(2, 2, 16, 64, 16), warn=True) is False
    with pytest.raises(
        UserError, match=r"^data\.packing: always, but Leaky does not keep packed examples apart"
    ):
        packs(_cfg("always"), Leaky(2, 2, 16, 64, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # never: no probe, no warning
        assert packs(_cfg("never"), Leaky(2, 2, 16, 64, 16), warn=True) is False


def test_a_model_without_position_ids_does_not_pack() -> None:
    v = packing.packs_examples(NoPositions())
    assert not v.ok and v.why == "NoPositions.forward takes no position_ids"


def test_the_verdict_is_cached_per_class_and_versions(tmp_path, monkeypatch) -> None:
    assert packing.packs_examples(Leaky(2, 2, 16, 64, 16)).ok is False
    data = json.loads((tmp_path / "cache" / "model-verdicts.json").read_text())
    (key,) = [k for k in data if "Leaky" in k]
    assert f"torch {torch.__version__}" in key and data[key]["ok"] is False

    def no_probe(model):
        raise AssertionError("probed again")

    monkeypatch.setattr(packing, "probe", no_probe)
    assert packing.packs_examples(Leaky(2, 2, 16, 64, 16)).ok is False  # from the cache
    (tmp_path / "cache" / "model-verdicts.json").write_text("[not a mapping")  # a damaged cache is no verdict
    monkeypatch.setattr(packing, "probe", lambda m: twin.Verdict(True, ""))
    assert packing.packs_examples(Leaky(2, 2, 16, 64, 16)).ok is True
