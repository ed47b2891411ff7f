"""The HF slice of the pattern zoo: tiny random-weight transformers models (dense, GQA, tied, parallel-residual,
MoE) on 2 ranks x ZeRO stages 2 and 3, with and without activation checkpointing, equal the plain reference.

Every config is fp32, dropout-free and per-sample independent (no padding, no MoE capacity, no router jitter),
so the reference's one forward over the whole global batch and zoff's micro-batches on 2 ranks compute the
same function. `train.activation_checkpointing: true` must switch on HF gradient checkpointing; the reference
never checkpoints, which is mathematically the same.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import assert_close_losses, assert_close_params, reference_run, run_zoff_many, tiny_cfg
from zoff.config import config_from_dict
from zoff.models import lm_loss
from zoff.trainer.session import build_session

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORLD = 2
# Four steps: three updates that a later forward uses (a stale unit or optimizer state shows from step 2 on,
# as does stage 3's prefetch, which follows the gather order recorded in step 1), and the reference's loss
# falls by 0.06-0.07 in every model (0.06-0.09 at six steps), at 2/3 of six steps' time.
STEPS = 4
GQA = {"intermediate_size": 48, "num_key_value_heads": 1}
# n_layer/n_head/d_model/seq_len are zoff's keys; model.config holds the class-specific ones. vocab_size is
# zoff's default 256, every dropout zoff's default 0. "eager" and "sdpa" both give split-independent losses
# on CPU in fp32 (full batch vs 4 micro-batches: loss within 1e-7, gradients within 7e-7 relative).
MODELS = {
    "llama": {"name": "hf:LlamaForCausalLM", "tie_embeddings": False, "config": GQA},
    "qwen2": {"name": "hf:Qwen2ForCausalLM", "tie_embeddings": True, "config": GQA},  # tied, q/k/v biases
    "gpt2": {"name": "hf:GPT2LMHeadModel", "config": {"n_inner": 48}},  # tied wte/lm_head, Conv1D
    "neox": {  # parallel residual, partial rotary
        "name": "hf:GPTNeoXForCausalLM", "tie_embeddings": False, "config": {"intermediate_size": 48},
    },
    "mixtral": {  # 4 experts, top-2, no aux loss, no router jitter: routing is per token
        "name": "hf:MixtralForCausalLM", "tie_embeddings": False,
        "config": {
            **GQA, "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None,
        },
    },
}  # fmt: skip
# (ZeRO stage, activation checkpointing). Stage 3 + checkpointing is the cell that catches a recompute in
# backward that leaves a gathered unit stale across a step: torch's non-reentrant checkpoint stops the
# recompute early by default, inside the last module's forward, so that module's post-forward hook never runs.
CELLS = [(2, False), (2, True), (3, False), (3, True)]


def _model(name: str) -> dict:
    m = MODELS[name]
    config = {**m["config"], "attn_implementation": "sdpa"}
    return {**m, "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "dropout": 0.0, "config": config}


def _cfg(name: str, stage: int, checkpointing: bool) -> dict:
    # persistence threshold 64 keeps norms/biases persistent at stage 3; a small bucket makes several.
    return tiny_cfg(
        model=_model(name),
        zero={"stage": stage, "param_persistence_threshold": 64, "reduce_bucket_size": 3000},
        train={"max_steps": STEPS, "activation_checkpointing": checkpointing, "eval_batches": 1},
    )


def _cell_id(cell: tuple[int, bool]) -> str:
    return f"stage{cell[0]}-{'ac' if cell[1] else 'noac'}"


@pytest.fixture(scope="module")
def hf_runs() -> dict[tuple[str, int, bool], dict]:
    """Every (model, stage, checkpointing) run, all in one spawn of 2 ranks."""
    keys = [(name, stage, ac) for name in MODELS for stage, ac in CELLS]
    results = run_zoff_many([_cfg(*k) for k in keys], WORLD)
    return dict(zip(keys, results, strict=True))


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {name: reference_run(config_from_dict(_cfg(name, 2, False)), WORLD) for name in MODELS}


@pytest.mark.parametrize("cell", CELLS, ids=_cell_id)
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_matches_reference(hf_runs, references, name: str, cell: tuple[int, bool]) -> None:
    got, ref = hf_runs[(name, *cell)], references[name]
    assert_close_losses(got["losses"], ref["losses"])
    assert_close_losses(got["grad_norms"], ref["grad_norms"])
    assert_close_params(got["params"], ref["params"])
    assert ref["losses"][-1] < ref["losses"][0]  # the comparison is over a run that actually learns


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _count_forwards(layers: list[torch.nn.Module]) -> list[int]:
    """Live per-layer counts of forward calls of the layer's first leaf module (a norm or projection).

    Not the layer's own hooks: transformers 5.2x checkpoints a layer's `forward`, not its `__call__`, so the
    recompute in backward runs the layer's submodules again but not the layer's own hooks.
    """
    counts = [0] * len(layers)
    for i, layer in enumerate(layers):
        leaf = next(m for m in layer.modules() if not list(m.children()))
        leaf.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def _checkpointing_on(model: torch.nn.Module) -> bool:
    # is_activation_checkpointing from transformers 5.2x on (is_gradient_checkpointing is its deprecated alias)
    flag = "is_activation_checkpointing"
    return bool(getattr(model, flag if hasattr(type(model), flag) else "is_gradient_checkpointing"))


@pytest.mark.parametrize("name", list(MODELS))
def test_activation_checkpointing_turns_on_hf_gradient_checkpointing(name: str) -> None:
    """With the switch on, every decoder layer runs its forward again during backward; off, only once."""
    calls, flags = {}, {}
    for checkpointing in (False, True):
        cfg = config_from_dict(_cfg(name, 2, checkpointing))
        s = build_session(cfg, torch.device("cpu"))  # torch.distributed not initialised: world 1
        model = s.engine.model
        layers = _decoder_layers(model)
        assert len(layers) == 2
        counts = _count_forwards(layers)
        model.train()
        s.engine.zero_grad()
        x, y = s.batches.micro_batch_at(0, 0)
        s.engine.backward(lm_loss(model(x), y))
        calls[checkpointing], flags[checkpointing] = counts, _checkpointing_on(model)
    assert calls == {False: [1, 1], True: [2, 2]}, (
        f"decoder-layer forwards in one forward+backward, by train.activation_checkpointing: {calls}"
    )
    assert flags == {False: False, True: True}, f"model.is_activation_checkpointing: {flags}"
