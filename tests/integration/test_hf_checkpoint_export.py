"""An hf: run started from a sharded safetensors folder (shard-only loading) exports with `zoff convert --format
hf` to a folder from_pretrained loads with exactly the trained weights, and (issue 18 item 4) its checkpoint
carries the model's config.json and generation_config.json, so the export works after the folder is gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.harness import run_zoff, tiny_cfg
from zoff.checkpoint.convert import convert
from zoff.checkpoint.format import find_checkpoint, read_model_files, write_model_files
from zoff.config import ModelConfig
from zoff.errors import UserError
from zoff.models import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
    vocab_size=256, max_position_embeddings=32, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf-export")
    folder = root / "llama"
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    model.generation_config.max_new_tokens = 7  # something of its own to carry
    model.save_pretrained(str(folder), max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert (folder / "generation_config.json").is_file()
    cfg = tiny_cfg(
        model={"name": "hf:LlamaForCausalLM", "path": str(folder)},
        zero={"stage": 3, "param_persistence_threshold": 64},
        train={"max_steps": 2, "eval_batches": 1},
    )
    run = root / "run"
    results = run_zoff(cfg, 2, run_dir=run)
    return {"root": root, "folder": folder, "ckpt": run / "checkpoints", "params": results[0]["params"]}


def _assert_loads_exactly(out: Path, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    got = dict(loaded.named_parameters(remove_duplicate=False))
    assert set(got) == set(params)
    for name, p in params.items():
        assert torch.equal(got[name].detach(), p), name
    return loaded


def test_convert_round_trip_is_exact(trained) -> None:
    out = trained["root"] / "export-with-folder"
    convert(trained["ckpt"], out, "hf", "fp32")
    _assert_loads_exactly(out, trained["params"])


def test_checkpoint_carries_the_hf_config_and_exports_without_the_folder(trained) -> None:
    step = find_checkpoint(str(trained["ckpt"]), Path("."))
    stored = read_model_files(step)
    assert stored["config.json"]["architectures"] == ["LlamaForCausalLM"]
    assert stored["generation_config.json"]["max_new_tokens"] == 7
    gone = trained["root"] / "llama-moved"
    shutil.move(trained["folder"], gone)  # the folder the run started from is gone
    try:
        out = trained["root"] / "export-without-folder"
        convert(trained["ckpt"], out, "hf", "fp32")
        loaded = _assert_loads_exactly(out, trained["params"])
        assert loaded.generation_config.max_new_tokens == 7
        assert json.loads((out / "config.json").read_text())["use_cache"] is True
    finally:
        shutil.move(gone, trained["folder"])


def test_convert_uses_the_stored_config_and_names_what_is_missing(trained, tmp_path) -> None:
    """convert's side on its own: a step folder holding the model files exports without the model folder;
    one without them (an older checkpoint) says what is missing in one line."""
    step = tmp_path / "step"
    shutil.copytree(find_checkpoint(str(trained["ckpt"]), Path(".")), step)
    manifest = json.loads((step / "manifest.json").read_text())
    for name in ("hf_config.json", "hf_generation_config.json"):  # as saved before checkpoints carried them
        (step / name).unlink(missing_ok=True)
        manifest["files"].pop(name, None)
    (step / "manifest.json").write_text(json.dumps(manifest))
    gone = trained["root"] / "llama-moved"
    shutil.move(trained["folder"], gone)
    try:
        with pytest.raises(
            UserError, match=r"^--format hf: .* carries no model config .* has no config.json"
        ):
            convert(step, tmp_path / "refused", "hf", "fp32")
        model = build_model(ModelConfig(name="hf:LlamaForCausalLM", path=str(gone)))
        files = write_model_files(step, model)  # what save_checkpoint writes beside config.yaml
        assert set(files) == {"hf_config.json", "hf_generation_config.json"}
        out = tmp_path / "export"
        convert(step, out, "hf", "bf16")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        assert loaded.dtype == torch.bfloat16 and loaded.generation_config.max_new_tokens == 7
        for name, p in loaded.named_parameters():
            assert torch.equal(p, trained["params"][name].to(torch.bfloat16)), name
    finally:
        shutil.move(gone, trained["folder"])
