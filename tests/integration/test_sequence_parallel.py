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
    """(the third: rotary positions, rotated on each shard by its positions in the whole sequence)"""
    stage_3 = {"stage": 3, "param_persistence_threshold": 64}
    cfgs = [_cfg(2, {"stage": 2}), _cfg(4, stage_3), _cfg(2, stage_3, {"positions": "rotary"})]
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
    # one sliding layer, one full: a model that does not pass its window to the attention function
    "qwen2_moe": {"name": "hf:Qwen2MoeForCausalLM", "config": {
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": SEQ, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
        "output_router_logits": False}},
}  # fmt: skip


def test_transformers_llama_qwen3_mistral_and_qwen2_moe_equal_one_rank():
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


def _split_rank(rank: int, world: int, bypass: bool, positions: bool) -> str:
    from zoff.models import build_model
    from zoff.models.sequence_split import split_attention
    from zoff.models.ulysses import sequence_group

    model = build_model(config_from_dict(_cfg(2)).model)
    split_attention(model, sequence_group(2))
    if bypass:
        model.blocks[1].attn.exchange = None  # one layer attends over its own tokens only
    kwargs = {"position_ids": torch.arange(SEQ // 2).unsqueeze(0) + rank * SEQ // 2} if positions else {}
    try:
        model(torch.zeros(1, SEQ // 2, dtype=torch.long), **kwargs)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "bypass, positions, says",
    [
        (True, True, "1 of GPT's 2 attention layers did not go through the sequence exchange"),
        (False, False, "GPT was called without position_ids"),
        (False, True, "no error"),
    ],
)
def test_a_layer_around_the_exchange_or_a_forward_without_positions_is_an_error(bypass, positions, says):
    assert says in spawn(_split_rank, 2, bypass, positions)[0]


def test_rotary_scalings_that_follow_the_shards_positions_are_refused():
    """dynamic and longrope pick their frequencies from the largest position of the call: a shard's."""
    transformers = pytest.importorskip("transformers")
    from zoff.errors import UserError
    from zoff.models.sequence_split import splittable

    for rope in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}):
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64, rope_parameters={"rope_theta": 10000.0, **rope},
        )  # fmt: skip
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        if rope["rope_type"] == "linear":
            splittable(model, 2)  # a fixed scaling splits
            continue
        with pytest.raises(
            UserError, match="rotary embedding \\(dynamic\\) scales with the longest position"
        ):
            splittable(model, 2)


def test_a_resume_at_another_global_batch_is_refused(tmp_path):
    """Without train.global_batch_size, N 2 -> 1 doubles the global batch: the data's place would skip samples.
    The ranks refuse it, and so does the pre-flight, naming the key to set."""
    from zoff.config import config_from_dict as load
    from zoff.errors import UserError
    from zoff.launch.preflight import check_resumed_batch

    cfg = _cfg(2, {"stage": 1}, max_steps=2)
    del cfg["train"]["global_batch_size"]
    cfg["checkpoint"] = {"every_steps": 2}
    run_zoff(cfg, 2, tmp_path / "n2")
    step_2 = tmp_path / "n2" / "checkpoints" / "step_00000002"
    again = {**cfg, "train": {**cfg["train"], "sequence_parallel": 1}, "launch": {"nproc_per_node": 2}}
    said = "checkpoint: saved at a global batch of 2 sequences, this run's is 4"
    with pytest.raises(RuntimeError, match=said):
        run_zoff(again, 2, tmp_path / "n1", resume=str(step_2))
    with pytest.raises(UserError, match=said + ".*set train.global_batch_size: 2"):
        check_resumed_batch(load(again), step_2)
    check_resumed_batch(load({**again, "train": {**again["train"], "global_batch_size": 2}}), step_2)
    # a manifest whose global batch is not a count is one line naming the file, not a traceback
    import json

    manifest = json.loads((step_2 / "manifest.json").read_text())
    for bad in ("2", [2], -1):
        manifest["trainer"]["data"]["global_batch"] = bad
        (step_2 / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(UserError, match="manifest.json: trainer.data.global_batch is .*, not a count"):
            check_resumed_batch(load(again), step_2)


@pytest.mark.grid
def test_compiled_blocks_with_the_exchange_eager_between_them():
    """train.compile: each block compiled, the exchange (collectives) left eager inside it."""
    cfg = _cfg(2, {"stage": 3, "param_persistence_threshold": 64}, compile=True, compile_backend="aot_eager")
    got = run_zoff(cfg, 2)[0]
    assert got["compiled_graphs"] > 0
    _assert_equals_one_rank(got, cfg)


@pytest.mark.grid
def test_lora_at_n_2_equals_the_peft_reference(tmp_path):
    """peft's wrapper around a transformers Llama: the split finds the base model under it."""
    transformers = pytest.importorskip("transformers")
    from tests.integration.test_lora import _cfg as lora_cfg
    from tests.integration.test_lora import peft_reference

    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    cfg = lora_cfg("llama", "zero3", str(tmp_path / "llama"))
    cfg["train"]["sequence_parallel"] = 2
    got = run_zoff(cfg, 2)[0]
    want = reference_run(config_from_dict(cfg), 1, build=peft_reference)  # (one data rank)
    want["params"] = {k.removeprefix("base_model.model."): v for k, v in want["params"].items()}
    assert_close_losses(got["losses"], want["losses"])
    assert_close_params(got["params"], want["params"])
