"""Random init of hf: models without model.path, shard by shard (zoff/models/hf_init.py): on 1, 2 and 3 ranks
each rank draws only the parameters that meet its shards, the engine's weights equal zoff's whole build of the
same model bit for bit, and they follow the model's own _init_weights; a 1 GB model builds on 2 ranks at
stage 3 with RSS growth bounded by the rank's model states plus two units. A model that _init_weights cannot
draw module by module is found at build time and built whole by transformers, as before."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn

from tests.harness import (
    GRID_WORLD_3,
    LazyRuns,
    assert_built_within_shard,
    build_measured,
    recording_init,
    spawn,
)
from zoff.config import ModelConfig, OptimConfig, ZeroConfig
from zoff.engine import build_engine
from zoff.models import build_for_engine, build_model, builds_sharded

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SEED = 7
THRESHOLD = 64  # stage 3: norms in persistent units, matrices sharded: both init paths run
SMALL = dict(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
    vocab_size=96, max_position_embeddings=32, initializer_range=0.05,
)  # fmt: skip
# 1.07 GB in fp32, as test_hf_shard_loading's: 12 layers of 67 MB, two 131 MB embedding tables.
BIG = dict(
    hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8, intermediate_size=4096,
    vocab_size=32000, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def _cfg(**config) -> ModelConfig:
    return ModelConfig(name="hf:LlamaForCausalLM", config=config)


def _rank(rank: int, world: int) -> dict:
    out = {}
    for tied in (False, True):
        for stage in (1, 3):
            torch.manual_seed(SEED)  # the trainer seeds every rank alike before building the model
            model = build_for_engine(_cfg(**SMALL, tie_word_embeddings=tied))
            calls = recording_init(model)
            engine = build_engine(
                model, ZeroConfig(stage=stage, param_persistence_threshold=THRESHOLD), OptimConfig()
            )
            out[tied, stage] = {
                "params": engine.gathered_params(),
                "calls": calls,
                "numel": engine.plan.numel,
            }
            engine.close()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return LazyRuns(lambda world: spawn(_rank, world))


@pytest.mark.parametrize("world", GRID_WORLD_3)
@pytest.mark.parametrize("tied", [False, True])
def test_shard_by_shard_init_equals_the_whole_build(runs, world: int, tied: bool) -> None:
    cfg = _cfg(**SMALL, tie_word_embeddings=tied)
    assert builds_sharded(cfg)
    torch.manual_seed(SEED)
    whole = build_model(cfg)
    want = dict(whole.named_parameters(remove_duplicate=False))
    for stage in (1, 3):
        for rank, result in enumerate(runs[world]):
            got = result[tied, stage]["params"]
            assert set(got) == set(want)
            for name, p in want.items():
                assert torch.equal(got[name], p.detach()), (world, stage, rank, name)
            drawn = Counter(result[tied, stage]["calls"])
            if world > 1:  # a rank draws the parameters meeting its shards, not the model
                assert (
                    sum(dict(whole.named_parameters())[n].numel() for n in drawn)
                    < result[tied, stage]["numel"]
                )


def test_the_values_follow_the_models_own_init_and_the_seed() -> None:
    torch.manual_seed(SEED)
    a = build_model(_cfg(**SMALL))
    torch.manual_seed(SEED + 1)
    b = build_model(_cfg(**SMALL))
    for name, p in a.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name  # LlamaRMSNorm: ones
        else:  # Linear and Embedding weights: normal(0, initializer_range)
            assert abs(p.std().item() - 0.05) < 0.01 and abs(p.mean().item()) < 0.01, name
            assert not torch.equal(p, dict(b.named_parameters())[name]), name  # another seed, other values
    layers = [dict(a.named_parameters())[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(3)]
    assert not torch.equal(layers[0], layers[1])  # each module its own draw


class _WithExtra(transformers.LlamaForCausalLM):
    """A model with a parameter its _init_weights does not know (only a model-level init would set it)."""

    def __init__(self, config):
        super().__init__(config)
        self.extra = nn.Parameter(torch.zeros(3))


def test_a_model_init_weights_cannot_draw_module_by_module_is_built_whole() -> None:
    from zoff.models.hf_init import build_random_hf, initialisable

    config = transformers.LlamaConfig(**SMALL)
    assert not initialisable(_WithExtra, config)
    assert build_random_hf(_WithExtra, config, whole=True) is None
    assert initialisable(transformers.LlamaForCausalLM, config)


# ---------------------------------------------------------------------------------------- 1 GB, RSS


def _big_rank(rank: int, world: int) -> dict | None:
    return build_measured(
        _cfg(**BIG),
        THRESHOLD,
        lambda e: {"finite": all(bool(torch.isfinite(s).all()) for s in e.shard_params)},
    )


def test_one_gigabyte_model_initialises_within_its_shard_on_two_ranks() -> None:
    numel = sum(math.prod(p.shape) for p in build_for_engine(_cfg(**BIG)).parameters())
    assert numel * 4 >= 10**9  # 1 GB in fp32
    results = spawn(_big_rank, 2)
    assert all(r is None or r["finite"] for r in results)
    assert_built_within_shard(results, "initialising the model")


TINY = {
    "GPT2": dict(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16),
    "Mamba": dict(hidden_size=16, num_hidden_layers=2, vocab_size=32),
    "GptOss": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                   head_dim=8, intermediate_size=32, vocab_size=32),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(TINY))
def test_parents_init_weights_are_drawn_alike_whole_and_by_shard(family: str) -> None:
    """GPT-2 scales its residual projections from the model's _init_weights; Mamba and GPT-OSS set
    parameters of a module from its parent's: the whole build draws each value with the model on meta, as
    the engine's init_parameter does, so the two agree and every parameter is set."""
    from zoff.models.hf_init import build_random_hf

    config = getattr(transformers, f"{family}Config")(**TINY[family])
    cls = getattr(transformers, "GPT2LMHeadModel" if family == "GPT2" else f"{family}ForCausalLM")
    torch.manual_seed(SEED)
    whole = build_random_hf(cls, config, whole=True)
    torch.manual_seed(SEED)
    deferred = build_random_hf(cls, config, whole=False)
    assert whole is not None and deferred is not None
    for name, p in whole.named_parameters():
        out = torch.empty(p.shape)
        deferred.init_parameter(name, out)
        assert not out.isnan().any() and torch.equal(out, p.detach()), name


class _ToyConfig(transformers.PretrainedConfig):
    model_type = "zoff-toy"

    def __init__(self, data: bool = False, **kw):
        self.data = data
        super().__init__(pad_token_id=0, **kw)


class _Toy(transformers.PreTrainedModel):
    """An embedding that _init_weights sets through .data (whole), or of which it sets only the padding row."""

    config_class = _ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.emb = nn.Embedding(8, 4, padding_idx=0)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):
            if self.config.data:
                module.weight.data.normal_(0.0, 0.02)
            module.weight[module.padding_idx].zero_()


def test_a_parameter_set_only_in_part_is_not_taken_for_drawn() -> None:
    from zoff.models.hf_init import build_random_hf, initialisable

    assert not initialisable(_Toy, _ToyConfig())  # one row of eight: built whole by transformers instead
    assert build_random_hf(_Toy, _ToyConfig(), whole=True) is None
    assert initialisable(_Toy, _ToyConfig(data=True))  # weight.data.normal_ sets it whole
    model = build_random_hf(_Toy, _ToyConfig(data=True), whole=True)
    assert not model.emb.weight.isnan().any() and torch.equal(model.emb.weight[0], torch.zeros(4))
