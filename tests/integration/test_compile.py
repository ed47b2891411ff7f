"""train.compile: each repeated block compiled on its own gives the uncompiled run's losses and weights, with
the engine's hooks (stage 3's gathers, offload, activation checkpointing) around the compiled blocks.

The default suite runs aot_eager (Dynamo and AOTAutograd: where compiled code meets the engine's hooks,
storage resizes and checkpoint recomputes) on two ranks, and Inductor (generated C++ kernels) on one; the
grid adds the disk tier, Inductor on two ranks, the Hugging Face Llama with LoRA and full fine-tuning at
stage 3.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.datafiles import chat_llama_files
from tests.harness import assert_close_losses, assert_close_params, run_zoff_many, tiny_cfg
from zoff.errors import UserError
from zoff.trainer.compile import compile_blocks

pytestmark = pytest.mark.slow

CELLS = [  # (id, world, zero section, activation checkpointing, backend)
    ("stage3-param-offload-ckpt", 2, {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                      "offload_param": {"device": "cpu"}}, True, "aot_eager"),
    ("stage1-inductor-ckpt", 1, {"stage": 1}, True, "inductor"),
]  # fmt: skip
GRID_CELLS = [
    ("stage2-nvme", 2, {"stage": 2, "offload_optimizer": {"device": "nvme"}}, False, "aot_eager"),
    ("stage3-inductor", 2, {"stage": 3}, False, "inductor"),
    ("stage0-inductor", 2, {"stage": 0}, True, "inductor"),
]


def _pair(tmp_path, zero: dict, ckpt: bool, backend: str, **sections) -> list[dict]:
    zero = {**zero, "param_persistence_threshold": 64}
    if zero.get("offload_optimizer", {}).get("device") == "nvme":
        zero["offload_optimizer"] = {**zero["offload_optimizer"], "nvme_path": str(tmp_path / "swap")}
    train = {"max_steps": 6, "activation_checkpointing": ckpt, **sections.pop("train", {})}
    base = tiny_cfg(zero=zero, train=train, **sections)
    compiled = tiny_cfg(zero=zero, train={**train, "compile": True, "compile_backend": backend}, **sections)
    return [base, compiled]


def _check(results: list[dict]) -> None:
    eager, compiled = results
    assert (
        eager["compiled_graphs"] == 0 and compiled["compiled_graphs"] >= 1
    )  # (run in this order, one process)
    assert_close_losses(compiled["losses"], eager["losses"], rtol=1e-5)
    assert_close_params(compiled["params"], eager["params"], rtol=1e-5)


@pytest.mark.parametrize("cell", CELLS + [pytest.param(c, marks=pytest.mark.grid) for c in GRID_CELLS],
                         ids=[c[0] for c in CELLS + GRID_CELLS])  # fmt: skip
def test_compiled_blocks_train_as_the_eager_ones(cell, tmp_path) -> None:
    _, world, zero, ckpt, backend = cell
    _check(run_zoff_many(_pair(tmp_path, zero, ckpt, backend), world))


def test_compiled_blocks_with_offloaded_inputs_and_tiled_mlps_train_as_the_eager_ones(tmp_path) -> None:
    """The long-sequence switches around compiled blocks: the blocks' inputs through the offloading checkpoint
    (outside the compiled region) and each MLP in tiles with its own checkpoint (inside it)."""
    train = {"activation_offload": True, "mlp_tile": 8}
    _check(run_zoff_many(_pair(tmp_path, {"stage": 3}, True, "aot_eager", train=train), 1))


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    return chat_llama_files(tmp_path_factory.mktemp("compile-llama"), 32)


@pytest.mark.grid
@pytest.mark.parametrize("lora", [False, True], ids=["sft", "lora"])
def test_compiled_llama_blocks_train_as_the_eager_ones(lora: bool, llama_files, tmp_path) -> None:
    """The HF Llama's decoder layers (its _no_split_modules) compiled, full fine-tuning and LoRA, stage 3."""
    model = {"name": "hf:LlamaForCausalLM", "path": llama_files["llama"], "seq_len": 32}
    if lora:
        model["lora"] = {"r": 4, "alpha": 8.0}
    data = {"name": "jsonl", "paths": [llama_files["data"]], "format": "chat", "tokenizer": llama_files["tok"],
            "seq_len": 32, "batch_size": 2, "val_fraction": 0.1}  # fmt: skip
    cfgs = _pair(tmp_path, {"stage": 3}, True, "aot_eager", model=model, data=data,
                 optim={"lr": 3e-2 if lora else 3e-3})  # fmt: skip
    _check(run_zoff_many(cfgs, 2))


def test_a_model_without_repeated_blocks_is_refused() -> None:
    """Nothing to compile one by one: one line naming the model and the keys, before any step."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model.__class__ = type("TwoLayers", (nn.Sequential,), {})
    with pytest.raises(
        UserError, match=r"train\.compile: TwoLayers has no repeated blocks .* zero\.block_classes"
    ):
        compile_blocks(model, (), "aot_eager")


def test_blocks_named_in_block_classes_are_compiled_and_keep_their_results() -> None:
    """zero.block_classes picks what is compiled where the model has no layer list; the output is the eager one."""

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Mixer(), nn.Linear(8, 8)

        def forward(self, x):
            return self.second(self.first(x))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 8)
    want = net(x)
    compiled = compile_blocks(net, ("Mixer",), "aot_eager")
    assert compiled.classes == (("Mixer", 1),)
    assert "1 x Mixer with torch.compile (aot_eager)" in compiled.describe()
    torch.testing.assert_close(net(x), want, rtol=0, atol=0)
