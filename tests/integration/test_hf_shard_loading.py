"""Shard-only loading of hf: models from a safetensors folder (issue 18, items 2 and 5): on 1, 2 and 3 ranks the
engine's weights equal from_pretrained's exactly, each rank reads only the parameters that meet its shards, and
a 1 GB model loads on 2 ranks at stage 3 with RSS growth bounded by the rank's model states plus two units."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

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
from zoff.engine.partition import PartitionPlan
from zoff.errors import UserError
from zoff.models import build_for_engine, builds_sharded

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORLDS = GRID_WORLD_3
STAGES = [1, 3]
THRESHOLD = 64  # stage 3: norms persistent (initialised in the full buffer), matrices in sharded units
SMALL = dict(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
    vocab_size=96, max_position_embeddings=32,
)  # fmt: skip
# 1.07 GB in fp32: 12 layers of 67 MB in three shards; the two 131 MB embedding tables are the largest units.
BIG = dict(
    hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8, intermediate_size=4096,
    vocab_size=32000, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def _save(
    folder: Path, seed: int, *, tied: bool, dtype: torch.dtype, shard: str | None, base: bool = False
) -> Path:
    """A random Llama written by save_pretrained: several shards + index when `shard` is a size, one
    model.safetensors otherwise; `base` saves the bare LlamaModel (keys without the 'model.' prefix)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied)
    model = (transformers.LlamaModel if base else transformers.LlamaForCausalLM)(config).to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(folder), **kwargs)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-folders")
    out = {
        "sharded": _save(root / "sharded", 1, tied=False, dtype=torch.float32, shard="20KB"),
        "tied-bf16": _save(root / "tied-bf16", 2, tied=True, dtype=torch.bfloat16, shard="16KB"),
        "base-model": _save(root / "base-model", 3, tied=True, dtype=torch.float32, shard=None),
    }
    index = json.loads((out["sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3  # really several shards
    assert (
        "lm_head.weight"
        not in json.loads((out["tied-bf16"] / "model.safetensors.index.json").read_text())["weight_map"]
    )  # a tied lm_head is stored once, under the embedding's name
    return out


def _cfg(folder: Path) -> ModelConfig:
    return ModelConfig(name="hf:LlamaForCausalLM", path=str(folder))


def _load_rank(rank: int, world: int, folders: dict[str, str]) -> dict:
    out = {}
    for key, folder in folders.items():
        for stage in STAGES:
            model = build_for_engine(_cfg(Path(folder)))
            calls = recording_init(model)
            engine = build_engine(
                model, ZeroConfig(stage=stage, param_persistence_threshold=THRESHOLD), OptimConfig()
            )
            out[key, stage] = {
                "params": engine.gathered_params(),
                "buffers": {n: b.clone() for n, b in engine.model.named_buffers()},
                "calls": calls,
                "plan": engine.plan,
            }
            engine.close()
    return out


@pytest.fixture(scope="module")
def runs(folders) -> dict[int, list[dict]]:
    paths = {k: str(v) for k, v in folders.items()}
    return LazyRuns(lambda world: spawn(_load_rank, world, paths))


def _reference(folder: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("key", ["sharded", "tied-bf16", "base-model"])
def test_shard_only_loading_equals_from_pretrained(folders, runs, key: str, world: int) -> None:
    assert builds_sharded(_cfg(folders[key]))
    ref = _reference(folders[key])
    want = dict(ref.named_parameters(remove_duplicate=False))
    buffers = dict(ref.named_buffers())
    for stage in STAGES:
        for rank, result in enumerate(runs[world]):
            got = result[key, stage]
            assert set(got["params"]) == set(want), (key, stage, rank)
            for name, p in want.items():
                assert torch.equal(got["params"][name], p.detach()), (key, world, stage, rank, name)
            assert set(got["buffers"]) == set(buffers)
            for name, b in buffers.items():  # computed by the constructor, as from_pretrained's are
                assert torch.equal(got["buffers"][name], b), (key, name)


def _overlapping(plan: PartitionPlan, rank: int) -> Counter:
    drawn: Counter = Counter()
    for u in plan.all_units:
        lo, hi = plan.shard_range(u.index, rank)
        for si in u.slots:
            s = plan.all_slots[si]
            if max(lo, s.offset) < min(hi, s.offset + s.numel):
                drawn[s.names[0]] += 1
    return drawn


@pytest.mark.parametrize("world", GRID_WORLD_3[1:])
def test_each_rank_reads_only_the_parameters_it_owns(runs, world: int) -> None:
    for rank, result in enumerate(runs[world]):
        got = result["sharded", 3]
        plan: PartitionPlan = got["plan"]
        assert Counter(got["calls"]) == _overlapping(plan, rank), rank
        numel = {s.names[0]: s.numel for s in plan.all_slots}
        read = sum(numel[n] for n in got["calls"])
        assert read < plan.numel, f"rank {rank} read the whole model"


# ---------------------------------------------------------------------------------------- 1 GB, RSS


def _big_rank(rank: int, world: int, folder: str) -> dict | None:
    # What this rank holds, summed: over the ranks, the sum of every weight (no gather of 1 GB over gloo)
    return build_measured(
        _cfg(Path(folder)), THRESHOLD, lambda e: {"sum": sum(float(s.double().sum()) for s in e.shard_params)}
    )


def test_one_gigabyte_model_loads_within_its_shard_on_two_ranks(tmp_path) -> None:
    folder = tmp_path / "big"
    from transformers.initialization import no_init_weights

    with no_init_weights():  # transformers' own init of 267M parameters takes longer than the whole load
        big = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BIG))
    noise = torch.randn(
        max(p.numel() for p in big.parameters()) + 4096, generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        for i, p in enumerate(big.parameters()):  # random weights, a different window of the noise each
            p.view(-1).copy_(noise[i * 97 % 4096 :][: p.numel()])
    del noise
    big.save_pretrained(str(folder), max_shard_size="400MB")
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert size >= 10**9, size  # 1 GB
    want = sum(float(p.detach().double().sum()) for p in big.parameters())
    del big
    results = spawn(_big_rank, 2, str(folder))
    if None not in results:  # the ranks hold the file's weights between them, each element once
        assert sum(r["sum"] for r in results) == pytest.approx(want, rel=1e-9, abs=1e-6)
    assert_built_within_shard(results, "loading the model")


# ---------------------------------------------------------------------------------------------- errors


def test_missing_tensor_and_custom_code_are_one_line_errors(tmp_path, monkeypatch) -> None:
    from safetensors.torch import load_file, save_file

    folder = _save(tmp_path / "one", 4, tied=False, dtype=torch.float32, shard=None)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        UserError,
        match=r"^model.path: .*/one/model.safetensors has no tensor for parameter 'model.norm.weight'$",
    ):
        build_for_engine(_cfg(folder))

    custom = tmp_path / "custom"
    custom.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my-llama", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UserError,
        match=r"^model.path: .*config.json needs custom code .*model.config.trust_remote_code: true",
    ):
        build_for_engine(ModelConfig(name="hf:AutoModelForCausalLM", path=str(custom)))


def test_dtype_conversion_in_chunks(folders, monkeypatch) -> None:
    """bf16 file into fp32 buffers through a temporary far smaller than a tensor: still exact."""
    import zoff.models.safetensors_reader as reader

    monkeypatch.setattr(reader, "CHUNK_BYTES", 256)
    files = reader.WeightFiles(folders["tied-bf16"])
    key = "model.embed_tokens.weight"
    out = torch.empty(files.shape(key), dtype=torch.float32)
    files.read_into(key, out)
    assert torch.equal(out, files.read(key).float())
    assert out.numel() * 2 > 256 * 10  # many chunks


def test_persistent_buffers_are_read_and_others_keep_their_values(folders, tmp_path) -> None:
    """No transformers LM of these tests stores a buffer (rotary tables are recomputed), so one is added: a
    persistent buffer the folder stores is read (converted to the buffer's dtype); the others stay."""
    from safetensors.torch import load_file, save_file

    from zoff.models.hf_shards import _ShardLoader
    from zoff.models.safetensors_reader import WeightFiles

    folder = _save(tmp_path / "buf", 6, tied=True, dtype=torch.float32, shard=None)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.scale"] = torch.arange(4, dtype=torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = build_for_engine(_cfg(folder))
    model.model.register_buffer("scale", torch.zeros(4))  # persistent, as the class would declare it
    model.model.register_buffer("table", torch.ones(2), persistent=False)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    _ShardLoader(model, WeightFiles(folder)).load_buffers(model)
    assert torch.equal(model.model.scale, torch.arange(4, dtype=torch.float32))
    assert torch.equal(model.model.table, torch.ones(2))
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
