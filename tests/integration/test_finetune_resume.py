"""Fine-tuning runs resume exactly (issue 36 item 3): an SFT run (a transformers Llama from a folder, chat data,
answer-only loss, packed) and a LoRA run (adapters over a frozen base read from its folder) stopped at a
checkpoint and resumed continue bit for bit as the uninterrupted run on the same ranks, and within 1e-5 at
another world size (the same global batch: micro-batch x accumulation x ranks; only the reductions' order
differs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.datafiles import chat_llama_files
from tests.harness import assert_close_losses, assert_close_params, run_zoff, tiny_cfg

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow

SEQ = 128


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    return chat_llama_files(tmp_path_factory.mktemp("finetune-resume"), SEQ)


def _cfg(files: dict, kind: str, micro: int, accum: int, stage: int) -> dict:
    model = {"name": "hf:LlamaForCausalLM", "path": files["llama"], "seq_len": SEQ}
    if kind == "lora":
        model["lora"] = {"r": 4, "alpha": 8.0}
    return tiny_cfg(
        model=model,
        data={"name": "jsonl", "paths": [files["data"]], "format": "chat", "tokenizer": files["tok"],
              "seq_len": SEQ, "batch_size": micro, "val_fraction": 0.1, "packing": "always"},
        zero={"stage": stage, "param_persistence_threshold": 64},
        train={"max_steps": 4, "grad_accum": accum, "grad_clip": 1.0},
        optim={"lr": 3e-2 if kind == "lora" else 3e-3},
        checkpoint={"every_steps": 2, "keep_last": 5},
    )  # fmt: skip


def _resume_from_step_2(whole_dir: Path, into: Path) -> None:
    (into / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole_dir / "checkpoints" / "step_00000002", into / "checkpoints" / "step_00000002")


@pytest.mark.parametrize("kind, stage", [("sft", 3), ("lora", 3)])
def test_a_fine_tuning_run_resumes_bit_for_bit_and_at_another_world_size(
    files, tmp_path, kind, stage
) -> None:
    """2 ranks x micro-batch 2 x accumulation 2; resumed on the same 2 ranks, and on 1 rank with accumulation 4."""
    whole = run_zoff(_cfg(files, kind, 2, 2, stage), 2, tmp_path / "whole")[0]
    assert len(whole["losses"]) == 4
    _resume_from_step_2(tmp_path / "whole", tmp_path / "same")
    same = run_zoff(_cfg(files, kind, 2, 2, stage), 2, tmp_path / "same", resume="auto")[0]
    assert same["start"] == 2 and same["losses"] == whole["losses"][2:]
    for name, value in whole["params"].items():
        assert torch.equal(same["params"][name], value), name
    _resume_from_step_2(tmp_path / "whole", tmp_path / "one")
    one = run_zoff(_cfg(files, kind, 2, 4, stage), 1, tmp_path / "one", resume="auto")[0]
    assert one["start"] == 2
    assert_close_losses(one["losses"], whole["losses"][2:], rtol=1e-5)
    assert_close_params(one["params"], whole["params"], rtol=1e-5)
