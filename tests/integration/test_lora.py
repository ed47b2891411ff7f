"""LoRA through peft (model.lora) equals peft + plain PyTorch: the reference wraps the same base with peft's own
`get_peft_model`, starts from the same adapter values and trains the adapters with torch.optim.AdamW over the
same global batches. zoff runs it at every ZeRO stage and under zero3-offload, for the builtin GPT and for a
transformers Llama read from a model.path folder (the frozen base then partitioned at stage 3 and read shard
by shard). Only the adapters train, only they get optimizer state, and memory_report() agrees with the plan
that `zoff estimate` prints.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.harness import assert_close_losses, assert_close_params, reference_run, run_zoff_many, tiny_cfg
from zoff.config import LoraConfig, ModelConfig, config_from_dict
from zoff.models import build_model
from zoff.models.lora import LoraInit, lora_seed, resolve_targets

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS = 5
LORA = {"r": 4, "alpha": 8.0}
POLICIES = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3, "param_persistence_threshold": 64},
    "zero3-offload": {
        "stage": 3, "param_persistence_threshold": 64,
        "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    """A tiny random Llama saved as a Hugging Face folder: the base a fine-tune starts from."""
    folder = tmp_path_factory.mktemp("llama-base")
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _model(kind: str, folder: str) -> dict:
    if kind == "gpt":
        return {"lora": LORA}
    return {"name": "hf:LlamaForCausalLM", "path": folder, "seq_len": 16, "lora": LORA}


def _cfg(kind: str, policy: str, folder: str) -> dict:
    # LoRA wants a larger learning rate than full training (only the low-rank updates move)
    return tiny_cfg(
        model=_model(kind, folder), zero=POLICIES[policy], train={"max_steps": STEPS}, optim={"lr": 3e-2}
    )


def peft_reference(model_cfg: ModelConfig) -> torch.nn.Module:
    """The base built as zoff builds it (same seed), wrapped by peft's get_peft_model, with zoff's initial
    adapter values (lora_A drawn by name from train.seed, lora_B zero)."""
    base = build_model(dataclasses.replace(model_cfg, lora=LoraConfig()))
    lora = model_cfg.lora
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=resolve_targets(base, lora.target_modules),
    )  # fmt: skip
    model = peft.get_peft_model(base, config)
    init = LoraInit(None, lora_seed())
    for name, p in model.named_parameters():
        if p.requires_grad:
            init(name.removeprefix("base_model.model."), p.data)
    return model


@pytest.fixture(scope="module")
def runs(llama_folder) -> dict:
    keys = [(kind, policy) for kind in ("gpt", "llama") for policy in POLICIES]
    results = run_zoff_many([_cfg(*k, llama_folder) for k in keys], 1)
    return dict(zip(keys, results, strict=True))


@pytest.fixture(scope="module")
def references(llama_folder) -> dict:
    out = {}
    for kind in ("gpt", "llama"):
        ref = reference_run(config_from_dict(_cfg(kind, "zero0", llama_folder)), 1, build=peft_reference)
        ref["params"] = {k.removeprefix("base_model.model."): v for k, v in ref["params"].items()}
        out[kind] = ref
    return out


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_lora_matches_peft_reference(runs, references, kind: str, policy: str) -> None:
    got, ref = runs[(kind, policy)], references[kind]
    assert set(got["params"]) == set(ref["params"]) and all(".lora_" in n for n in got["params"])
    assert_close_losses(got["losses"], ref["losses"])
    assert_close_losses(got["grad_norms"], ref["grad_norms"])
    assert_close_params(got["params"], ref["params"])
    assert all(v.abs().max() > 0 for n, v in got["params"].items() if ".lora_B." in n)  # all adapters moved
    if kind == "llama":  # (a random GPT on random Markov bytes stays near ln 256 for these few steps)
        assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_only_adapters_get_optimizer_state(runs, kind: str, policy: str) -> None:
    """Adam's moments (8 B/param) for the adapters' elements only,
    and the allocation equals the plan (what `zoff estimate` prints for this policy)."""
    got = runs[(kind, policy)]
    adapters = sum(v.numel() for v in got["params"].values())
    mem = got["memory"]
    states = mem["optimizer_states"] + mem["cpu_optimizer_states"]
    assert adapters <= states / 8 < adapters + 64 * 16  # padding: a few elements per unit
    # the frozen base is most of the model (r 4 of 32); parameter offload keeps its shards in host memory
    assert mem["frozen_params"] + mem["cpu_params"] > 5 * mem["params"]
    if "offload" in policy:  # only the small frozen ones (norms) stay whole on the device
        assert mem["frozen_params"] < mem["cpu_params"] / 10
    planned = got["planned"]
    mem = {**mem, "params": mem["params"] + mem["frozen_params"]}
    assert {k: mem[k] for k in planned} == planned


def test_lora_on_two_ranks_at_stage3_matches_peft_reference(llama_folder) -> None:
    """The frozen base partitioned across 2 ranks and read shard by shard; the adapters sharded too; two
    micro-batches accumulated per step (tiny_cfg's grad_accum)."""
    cfgs = [_cfg("llama", p, llama_folder) for p in ("zero3", "zero3-offload")]
    ref = reference_run(config_from_dict(cfgs[0]), 2, build=peft_reference)
    ref["params"] = {k.removeprefix("base_model.model."): v for k, v in ref["params"].items()}
    for got in run_zoff_many(cfgs, 2):
        assert_close_losses(got["losses"], ref["losses"])
        assert_close_params(got["params"], ref["params"])


def test_lora_resume_reads_the_base_from_its_folder(llama_folder, tmp_path) -> None:
    """A checkpoint that names its base holds adapters only; resuming from it (the frozen weights read from
    model.path again) continues bit for bit as the uninterrupted run, and a changed base is refused."""
    import json
    import shutil

    from tests.harness import run_zoff
    from zoff.checkpoint.base_ref import weights_digest

    cfg = _cfg("llama", "zero3", llama_folder)
    cfg["checkpoint"] = {"every_steps": 2, "keep_last": 5}
    whole = run_zoff(cfg, 1, tmp_path / "whole")[0]
    ckpt = tmp_path / "whole" / "checkpoints" / "step_00000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["base"]["sha256"] == weights_digest(Path(llama_folder).resolve())
    assert all(".lora_" in n for p in manifest["params"] for n in p["names"])
    assert not list(ckpt.glob("frozen_*"))
    (tmp_path / "again" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, tmp_path / "again" / "checkpoints" / ckpt.name)
    again = run_zoff(cfg, 1, tmp_path / "again", resume="auto")[0]
    assert again["start"] == 2
    for name, value in whole["params"].items():
        assert torch.equal(again["params"][name], value), name
    # the same folder with other weights: the checkpoint is not for this base
    other = tmp_path / "other"
    shutil.copytree(llama_folder, other)
    model = transformers.LlamaForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    model.save_pretrained(other)
    moved = {**cfg, "model": {**cfg["model"], "path": str(other)}}
    with pytest.raises(
        Exception, match="other weights than the base this checkpoint was trained on"
    ):  # (a rank's)
        run_zoff(moved, 1, tmp_path / "again", resume="auto")
