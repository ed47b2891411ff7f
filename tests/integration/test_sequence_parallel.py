"""train.sequence_parallel (issue 55, Ulysses): N ranks share each sequence, each holding 1/N of its tokens,
and the run equals the one-rank run of the same global batches (plain PyTorch, torch.optim.AdamW) within 1e-5
in fp32: the builtin GPT at N = 2 and 4 (world 4: 2 sequence x 2 data ranks, and 4 x 1); stage 3 with CPU
offload and on the disk tier, with activation checkpointing, activation offload, loss and MLP tiles;
transformers' Llama (one key/value head, replicated), Qwen3 (GQA, q/k norms) and Mistral (a sliding window
shorter than the sequence); packed fine-tuning; a resume at another N. Bad N is one line and exit 2 before any
rank starts, and a layer that attends around the exchange is an error, not a plausible wrong number."""

from __future__ import annotations

import pytest
import torch

from tests.forked_zoff import zoff_run
from tests.harness import (
    TINY_LLAMA,
    assert_close_losses,
    assert_close_params,
    reference_run,
    run_zoff,
    run_zoff_many,
    spawn,
    tiny_cfg,
)
from zoff.config import config_from_dict

pytestmark = pytest.mark.slow

SEQ = 32


def _cfg(n: int, zero: dict | str | None = None, model: dict | None = None, **train) -> dict:
    """4 steps of 4 sequences of SEQ tokens, one per micro-batch: every world and N accumulates over the rest."""
    cfg = tiny_cfg(
        model={"n_head": 4, "seq_len": SEQ, **(model or {})},
        data={"seq_len": SEQ, "batch_size": 1},
        train={"max_steps": 4, "global_batch_size": 4, "sequence_parallel": n, **train},
    )
    if zero is not None:
        cfg["zero"] = zero
    return cfg


def _assert_equals_one_rank(got: dict, cfg: dict) -> None:
    want = reference_run(config_from_dict({**cfg, "train": {**cfg["train"], "sequence_parallel": 1}}), 1)
    assert_close_losses(got["losses"], want["losses"])
    assert_close_losses(got["grad_norms"], want["grad_norms"])
    assert_close_params(got["params"], want["params"])


def _nvme(swap) -> dict:
    io = {"threads": 2, "request_mb": 1}
    return {"stage": 3, "param_persistence_threshold": 64,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "io": io, "host_budget": "min"},
            "offload_param": {"device": "nvme", "nvme_path": str(swap), "io": io}}  # fmt: skip


def test_the_gpt_at_world_4_equals_one_rank_at_n_2_and_4():
    cfgs = [_cfg(2, {"stage": 2}), _cfg(4, {"stage": 3, "param_persistence_threshold": 64})]
    for got, cfg in zip(run_zoff_many(cfgs, 4), cfgs, strict=True):
        _assert_equals_one_rank(got, cfg)


def test_stage_3_offload_and_disk_with_the_long_sequence_switches(tmp_path):
    """(world 2, N 2: one data rank, accumulation over 4 micro-batches)"""
    switches = {"activation_checkpointing": True, "loss_tile": 8}
    cfgs = [
        _cfg(2, "zero3-offload", **switches, activation_offload=True, mlp_tile=8),
        _cfg(2, _nvme(tmp_path), **switches),
    ]
    for got, cfg in zip(run_zoff_many(cfgs, 2), cfgs, strict=True):
        _assert_equals_one_rank(got, cfg)


HF = {
    "llama": TINY_LLAMA,  # 2 heads, 1 key/value head: replicated to each rank
    "qwen3": {"name": "hf:Qwen3ForCausalLM", "config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256, "max_position_embeddings": SEQ}},
    "mistral": {"name": "hf:MistralForCausalLM", "config": {  # a window of 8 in sequences of 32
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": SEQ, "sliding_window": 8}},
}  # fmt: skip


def test_transformers_llama_qwen3_and_mistral_equal_one_rank():
    pytest.importorskip("transformers")
    cfgs = [_cfg(2, {"stage": 3, "param_persistence_threshold": 64}, m) for m in HF.values()]
    for got, cfg in zip(run_zoff_many(cfgs, 2), cfgs, strict=True):
        _assert_equals_one_rank(got, cfg)


def test_packed_fine_tuning_at_n_2_equals_plain_pytorch(tmp_path):
    """test_sft_equivalence's reference (each example alone, transformers' own chat masks) against a packed
    run whose every sequence is split over 2 ranks: the examples in one shard must not see another's."""
    pytest.importorskip("transformers")
    from tests.datafiles import chat_llama_files
    from tests.integration.test_sft_equivalence import SEQ as SFT_SEQ
    from tests.integration.test_sft_equivalence import _cfg as sft_cfg
    from tests.integration.test_sft_equivalence import reference

    files = chat_llama_files(tmp_path, SFT_SEQ)
    cfg = sft_cfg(files, 2, 3, 3, 4)
    cfg["train"]["sequence_parallel"] = 2
    got = run_zoff(cfg, 2)[0]
    want = reference(files)
    assert_close_losses(got["losses"], want["losses"])
    assert_close_losses(got["grad_norms"], want["grad_norms"])
    assert_close_params(got["params"], want["params"])


def test_a_run_resumes_at_another_n(tmp_path):
    """A run at N 2 (one data rank) saves at step 2; resumed from there at N 1 (two data ranks), its last two
    steps and its parameters are the one-rank reference's, as are the whole N 2 run's."""
    cfg = _cfg(2, {"stage": 3, "param_persistence_threshold": 64})
    cfg["checkpoint"] = {"every_steps": 2}
    whole = run_zoff(cfg, 2, tmp_path / "n2")[0]
    again = {**cfg, "train": {**cfg["train"], "sequence_parallel": 1}}
    step_2 = tmp_path / "n2" / "checkpoints" / "step_00000002"
    got = run_zoff(again, 2, tmp_path / "n1", resume=str(step_2))[0]
    want = reference_run(config_from_dict(again), 1)
    assert_close_losses(whole["losses"], want["losses"])
    assert got["start"] == 2
    assert_close_losses(got["losses"], want["losses"][2:])
    assert_close_params(got["params"], want["params"])


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["train.sequence_parallel=4"], "train.sequence_parallel: 4 does not divide the world size 2"),
        (["train.sequence_parallel=4", "launch.nproc_per_node=4", "model.n_head=2"],
         "train.sequence_parallel: 4 does not divide model.n_head 2"),
        (["train.sequence_parallel=2", "model.name=hf:GPT2LMHeadModel", "model.config.n_head=2"],
         "train.sequence_parallel: GPT2LMHeadModel cannot be split over ranks"),
    ],
)  # fmt: skip
def test_bad_n_is_one_line_and_nothing_starts(overrides, says, tmp_path):
    run_dir = tmp_path / "run"
    out = zoff_run(["train", "configs/quickstart.yaml", *overrides, "--run-dir", str(run_dir)], fresh=False)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr
    assert not run_dir.exists()


def _bypassing_rank(rank: int, world: int) -> str:
    from zoff.models import build_model
    from zoff.models.ulysses import sequence_group, split_attention

    model = build_model(config_from_dict(_cfg(2)).model)
    split_attention(model, sequence_group(2))
    model.blocks[1].attn.exchange = None  # one layer attends over its own tokens only
    try:
        model(torch.zeros(1, SEQ // 2, dtype=torch.long), position_ids=torch.arange(SEQ // 2).unsqueeze(0))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_layer_around_the_exchange_is_an_error():
    said = spawn(_bypassing_rank, 2)[0]
    assert "only 1 of GPT's 2 attention layers went through the sequence exchange" in said


@pytest.mark.grid
def test_compiled_blocks_with_the_exchange_eager_between_them():
    """train.compile: each block compiled, the exchange (collectives) left eager inside it."""
    cfg = _cfg(2, {"stage": 3, "param_persistence_threshold": 64}, compile=True, compile_backend="aot_eager")
    got = run_zoff(cfg, 2)[0]
    assert got["compiled_graphs"] > 0
    _assert_equals_one_rank(got, cfg)
