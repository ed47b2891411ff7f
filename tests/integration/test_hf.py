"""Hugging Face models: hf:Llama/GPT-2 on 2 ranks x stage 3 equal the plain reference, export to an HF folder
that from_pretrained loads with the same logits, model.path starts from the saved weights, HF tokenizers end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.datafiles import DOCS, make_tokenizer, write_jsonl
from tests.harness import reference_run, run_zoff, tiny_cfg
from zoff.checkpoint.convert import convert
from zoff.config import ModelConfig, config_from_dict
from zoff.data import GlobalBatches, load_corpus
from zoff.errors import UserError
from zoff.models import build_model, lm_loss

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LLAMA = {
    "name": "hf:LlamaForCausalLM", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16,
    "tie_embeddings": False, "config": {"intermediate_size": 48, "num_key_value_heads": 1},
}  # fmt: skip
GPT2 = {
    "name": "hf:GPT2LMHeadModel",
    "n_layer": 2,
    "n_head": 2,
    "d_model": 32,
    "seq_len": 16,
}  # tied wte/lm_head
STEPS = 6


def close_losses(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: zoff {a!r} vs reference {b!r}"


def model_with(cfg: dict, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(config_from_dict(cfg).model)
    missing, unexpected = model.load_state_dict(params, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(model.named_parameters())]
    return model.eval()


@pytest.mark.parametrize("model, via_cli", [(LLAMA, False), (GPT2, True)], ids=["llama", "gpt2"])
def test_hf_model_trains_like_the_reference_and_exports_to_from_pretrained(tmp_path, model, via_cli):
    cfg = tiny_cfg(
        model=model,
        zero={"stage": 3, "param_persistence_threshold": 64},
        train={"max_steps": STEPS, "eval_batches": 1},
    )
    run = tmp_path / "run"
    results = run_zoff(cfg, 2, run_dir=run)
    ref = reference_run(config_from_dict(cfg), 2)
    for r in results:
        close_losses(r["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0]
    trained = model_with(cfg, results[0]["params"])

    out = tmp_path / "hf-out"
    ckpt = run / "checkpoints"
    if via_cli:  # one shard: model.safetensors
        p = subprocess.run(
            [sys.executable, "-m", "zoff", "convert", str(ckpt), str(out), "--format", "hf"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert (out / "model.safetensors").is_file()
    else:  # several shards and their index
        convert(ckpt, out, "hf", "fp32", "20KB")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [model["name"][3:]] and config["vocab_size"] == 256
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded).__name__ == model["name"][3:]
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got = trained(x).logits, loaded(x).logits
    assert (got - want).abs().max().item() <= 1e-5


def test_model_path_and_hf_tokenizer_end_to_end(tmp_path):
    """A saved GPT-2 folder + a tiny BPE tokenizer folder + jsonl documents, on 2 ranks x stage 3."""
    tok_dir = make_tokenizer(tmp_path / "tok", DOCS, vocab=300)
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS * 5)
    saved = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )
    )  # fmt: skip
    with torch.no_grad():  # weights no random init of zoff's would give
        for p in saved.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    saved.save_pretrained(str(tmp_path / "gpt2-dir"))
    cfg = tiny_cfg(
        model={"name": "hf:GPT2LMHeadModel", "path": str(tmp_path / "gpt2-dir")},
        data={
            "name": "jsonl", "paths": [str(data)], "tokenizer": str(tok_dir), "seq_len": 16, "batch_size": 2,
            "cache_dir": str(tmp_path / "cache"),
        },
        zero={"stage": 3, "param_persistence_threshold": 64},
        train={"max_steps": 3, "eval_batches": 1},
    )  # fmt: skip
    results = run_zoff(cfg, 2)
    log = (tmp_path / "cache" / "tokens" / "builds.log").read_text().splitlines()
    assert len(log) == 1, "two ranks of one node must tokenize once"
    c = config_from_dict(cfg)
    corpus = load_corpus(c.data, c.train.seed)
    assert "cached" in corpus.description and corpus.vocab_size == 300
    x, y = GlobalBatches(corpus, 16, 2 * 2 * 2, 1, 0, 1, c.train.seed).micro_batch_at(0, 0)
    assert int(x.max()) >= 256  # the batches really hold BPE ids, not bytes
    with torch.no_grad():
        first = lm_loss(saved.train()(x), y).item()
    close_losses(results[0]["losses"][:1], [first])
    close_losses(results[0]["losses"], reference_run(c, 2)["losses"])


def test_hf_config_keys_and_errors():
    m = build_model(config_from_dict({"model": GPT2}).model)
    assert (m.config.n_embd, m.config.n_layer, m.config.n_positions, m.config.vocab_size) == (32, 2, 16, 256)
    assert m.config.resid_pdrop == 0.0 and m.config.use_cache is False and m.config.eos_token_id is None
    m = build_model(ModelConfig(name="hf:GPT2LMHeadModel", d_model=32, n_head=2, config={"n_embd": 64}))
    assert m.config.n_embd == 64  # model.config wins over zoff's keys, under any of its names
    with torch.device("meta"):
        m = build_model(
            ModelConfig(name="hf:AutoModelForCausalLM", n_head=2, d_model=32, config={"model_type": "llama"})
        )
    assert type(m).__name__ == "LlamaForCausalLM"
    for model, message in [
        (ModelConfig(name="hf:LlamaForCausalLm"), "model.name: transformers has no model class 'LlamaForCausalLm'"),
        (ModelConfig(name="hf:LlamaForCausalLM", config={"hiden_size": 8}), "model.config.hiden_size: not a LlamaConfig setting"),
        (ModelConfig(name="hf:LlamaForCausalLM", path="/nonexistent"), "model.path: /nonexistent has no config.json"),
    ]:  # fmt: skip
        with pytest.raises(UserError, match="^" + message):
            build_model(model)
    m = build_model(ModelConfig(name="hf:LlamaForCausalLM", n_layer=1, n_head=2, d_model=16, vocab_size=64))
    with pytest.raises(
        UserError, match=r"^data.tokenizer: token id 64 does not fit the model's vocabulary of 64"
    ):
        m(torch.tensor([[1, 64]]))
