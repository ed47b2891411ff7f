"""zoff.config: defaults, dotted overrides, recipes, validation messages, round trip, shipped YAMLs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import zoff.config as zc
from zoff.config import (
    Config,
    ConfigError,
    TrainConfig,
    ZeroConfig,
    config_from_dict,
    derive_grad_accum,
    dump_yaml,
    list_recipes,
    load_config,
)
from zoff.errors import UserError

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))
RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))
SHIPPED_RECIPES = ["zero0", "zero1", "zero2", "zero2-offload", "zero3", "zero3-offload"]


def error_of(raw: dict, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, overrides)
    return str(info.value)


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------------------------- defaults


def test_empty_config_is_all_defaults():
    cfg = config_from_dict({})
    assert cfg == Config()
    assert cfg.model.name == "gpt"
    assert cfg.data.name == "stdlib-source"
    assert (cfg.data.seq_len, cfg.data.batch_size) == (128, 8)
    assert cfg.zero.stage == 0 and cfg.zero.recipe is None
    assert cfg.zero.offload_optimizer.device == "none" and cfg.zero.offload_param.device == "none"
    assert cfg.optim.name == "adamw"
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.9, 0.95) and cfg.optim.eps == 1e-8
    assert cfg.optim.weight_decay == 0.1
    assert (cfg.schedule.warmup_steps, cfg.schedule.decay, cfg.schedule.min_lr_ratio) == (20, "cosine", 0.1)
    assert cfg.train.max_steps == 200 and cfg.train.grad_accum == 1 and cfg.train.global_batch_size is None
    assert (cfg.train.grad_clip, cfg.train.precision, cfg.train.seed, cfg.train.log_every) == (
        1.0,
        "fp32",
        0,
        10,
    )
    assert (cfg.checkpoint.dir, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last) == (None, 0, 2)
    assert (cfg.launch.nproc_per_node, cfg.launch.nnodes, cfg.launch.max_restarts) == (2, "1", 0)


def test_sections_given_as_null_or_empty_take_defaults():
    assert config_from_dict({"train": None, "zero": None, "optim": {}}) == Config()


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 5  # type: ignore[misc]


def test_load_config_reads_yaml_and_applies_overrides(tmp_path):
    p = write(tmp_path, "train:\n  max_steps: 10\n  seed: 3\n")
    cfg = load_config(p, ["train.max_steps=12"])
    assert cfg.train.max_steps == 12 and cfg.train.seed == 3
    assert load_config(str(p)).train.max_steps == 10  # str paths too, and overrides default to none


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError)  # the CLI turns every UserError into one line + exit 2


# --------------------------------------------------------------------------------------------- overrides


def test_overrides_use_yaml_scalar_typing():
    cfg = config_from_dict(
        {},
        [
            "train.max_steps=50",
            "optim.betas=[0.8,0.9]",
            "optim.lr=3e-4",
            "train.precision=bf16",
            "zero.overlap_comm=false",
            "train.global_batch_size=null",
            "checkpoint.dir=/tmp/ckpt",
            "data.paths=a.txt",
        ],
    )
    assert cfg.train.max_steps == 50 and type(cfg.train.max_steps) is int
    assert cfg.optim.betas == (0.8, 0.9) and type(cfg.optim.betas) is tuple
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float
    assert cfg.train.precision == "bf16"
    assert cfg.zero.overlap_comm is False
    assert cfg.train.global_batch_size is None
    assert cfg.checkpoint.dir == "/tmp/ckpt"
    assert cfg.data.paths == ["a.txt"]  # one path is a list of one


def test_later_override_wins_and_overrides_beat_the_file():
    cfg = config_from_dict({"train": {"max_steps": 5}}, ["train.max_steps=6", "train.max_steps=7"])
    assert cfg.train.max_steps == 7


def test_integral_float_is_an_int_but_a_fraction_is_not():
    assert config_from_dict({}, ["train.max_steps=50.0"]).train.max_steps == 50
    assert error_of({}, ("train.max_steps=1.5",)) == "train.max_steps: expected an integer, got 1.5"


def test_int_given_for_float_becomes_float():
    cfg = config_from_dict({"optim": {"lr": 1}})
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float


def test_stage_override_on_top_of_a_recipe_name_keeps_the_recipe_keys():
    cfg = config_from_dict({"zero": "zero2-offload"}, ["zero.stage=3"])
    assert cfg.zero.stage == 3
    assert cfg.zero.recipe == "zero2-offload"
    assert cfg.zero.offload_optimizer.device == "cpu"
    assert cfg.zero.offload_optimizer.pin_memory is True


def test_nested_override_on_top_of_a_recipe_name():
    cfg = config_from_dict({"zero": "zero3-offload"}, ["zero.offload_param.device=none"])
    assert cfg.zero.stage == 3
    assert cfg.zero.offload_param.device == "none"
    assert cfg.zero.offload_optimizer.device == "cpu"


def test_recipe_chosen_by_a_nested_override():
    cfg = config_from_dict({"zero": "zero0"}, ["zero.recipe=zero2-offload"])
    assert (cfg.zero.recipe, cfg.zero.stage, cfg.zero.offload_optimizer.device) == ("zero2-offload", 2, "cpu")


def test_whole_zero_section_override_with_a_recipe_name():
    # The form recipes/zero0.yaml's header documents: `zoff train CONFIG zero=zero0`.
    cfg = config_from_dict({"zero": "zero0"}, ["zero=zero2-offload"])
    assert (cfg.zero.recipe, cfg.zero.stage, cfg.zero.offload_optimizer.device) == ("zero2-offload", 2, "cpu")
    # Later nested overrides apply on top of the swapped-in recipe, in either order of mention.
    cfg = config_from_dict(
        {"zero": {"stage": 1, "reduce_bucket_size": 7}}, ["zero=zero3-offload", "zero.stage=2"]
    )
    assert (cfg.zero.recipe, cfg.zero.stage, cfg.zero.offload_param.device) == ("zero3-offload", 2, "cpu")
    assert cfg.zero.reduce_bucket_size == ZeroConfig().reduce_bucket_size  # the whole section was replaced


def test_free_form_model_args_accept_any_key():
    cfg = config_from_dict({}, ["model.args.hidden=64", "model.args.act=gelu"])
    assert cfg.model.args == {"hidden": 64, "act": "gelu"}


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.max_stepz=3",
            "override 'train.max_stepz=3': unknown key train.max_stepz (did you mean 'train.max_steps'?)",
        ),
        ("trian.max_steps=3", "override 'trian.max_steps=3': unknown key trian (did you mean 'train'?)"),
        ("nope.x=1", "override 'nope.x=1': unknown key nope"),
        (
            "zero.offload_optimizer.devise=cpu",
            "override 'zero.offload_optimizer.devise=cpu': unknown key zero.offload_optimizer.devise "
            "(did you mean 'zero.offload_optimizer.device'?)",
        ),
        ("train.max_steps.x=1", "override 'train.max_steps.x=1': train.max_steps is not a section"),
        ("train.max_steps", "override 'train.max_steps': expected KEY.PATH=VALUE"),
        ("train..max_steps=1", "override 'train..max_steps=1': empty key in 'train..max_steps'"),
    ],
)
def test_bad_override_messages(override, message):
    assert error_of({}, (override,)) == message


def test_override_values_are_validated_like_the_file():
    assert error_of({}, ("train.max_steps=abc",)) == "train.max_steps: expected an integer, got 'abc'"
    # YAML 1.1 reads `yes` as a boolean: still not an integer.
    assert error_of({}, ("train.max_steps=yes",)) == "train.max_steps: expected an integer, got True"


def test_nnodes_min_max_override_stays_a_range():
    assert config_from_dict({}, ["launch.nnodes=1:2"]).launch.nnodes == "1:2"


# ----------------------------------------------------------------------------------------------- recipes


def test_shipped_recipes_are_listed():
    assert set(SHIPPED_RECIPES) <= set(list_recipes())


@pytest.mark.parametrize(
    "name, stage, opt_dev, param_dev",
    [
        ("zero0", 0, "none", "none"),
        ("zero1", 1, "none", "none"),
        ("zero2", 2, "none", "none"),
        ("zero2-offload", 2, "cpu", "none"),
        ("zero3", 3, "none", "none"),
        ("zero3-offload", 3, "cpu", "cpu"),
    ],
)
def test_recipe_resolution(name, stage, opt_dev, param_dev):
    z = config_from_dict({"zero": name}).zero
    assert (z.recipe, z.stage, z.offload_optimizer.device, z.offload_param.device) == (
        name,
        stage,
        opt_dev,
        param_dev,
    )
    # The mapping form names the same recipe.
    assert config_from_dict({"zero": {"recipe": name}}).zero == z


def test_recipe_inherits_from_its_base_recipe():
    # recipes/zero2-offload.yaml says `recipe: zero2` and no stage: the stage comes from zero2.
    raw = yaml.safe_load((REPO / "recipes" / "zero2-offload.yaml").read_text())
    assert raw["zero"]["recipe"] == "zero2" and "stage" not in raw["zero"]
    assert config_from_dict({"zero": "zero2-offload"}).zero.stage == 2


def test_explicit_keys_win_over_the_recipe():
    z = config_from_dict(
        {
            "zero": {
                "recipe": "zero2-offload",
                "stage": 1,
                "offload_optimizer": {"pin_memory": False},
                "reduce_bucket_size": 1000,
            }
        }
    ).zero
    assert z.recipe == "zero2-offload"
    assert z.stage == 1
    assert z.offload_optimizer.device == "cpu"  # from the recipe: the nested section is merged, not replaced
    assert z.offload_optimizer.pin_memory is False
    assert z.reduce_bucket_size == 1000
    assert z.allgather_bucket_size == ZeroConfig().allgather_bucket_size


def test_unknown_recipe_suggests_the_closest():
    msg = error_of({"zero": "zero2-ofload"})
    assert msg.startswith("zero: unknown recipe 'zero2-ofload' (did you mean 'zero2-offload'?)")
    assert str(zc.RECIPES_DIR) in msg


def test_recipe_name_must_be_a_string():
    assert error_of({"zero": {"recipe": 3}}) == "zero.recipe: expected a recipe name (string), got int"


def test_recipe_cycle_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "a.yaml").write_text("zero:\n  recipe: b\n")
    (tmp_path / "b.yaml").write_text("zero:\n  recipe: a\n")
    monkeypatch.setattr(zc, "RECIPES_DIR", tmp_path)
    assert error_of({"zero": "a"}) == "zero.recipe: recipe cycle a -> b -> a"


def test_unknown_key_inside_a_recipe_is_reported_with_its_path(tmp_path, monkeypatch):
    (tmp_path / "r.yaml").write_text("zero:\n  stagee: 1\n")
    monkeypatch.setattr(zc, "RECIPES_DIR", tmp_path)
    assert error_of({"zero": "r"}) == "unknown key zero.stagee (did you mean 'zero.stage'?)"


# -------------------------------------------------------------------------------------------- validation


def test_yaml_string_3e_minus_4_is_accepted_as_a_float(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 3e-4\n")
    assert yaml.safe_load(p.read_text())["optim"]["lr"] == "3e-4"  # YAML 1.1 reads it as a string...
    lr = load_config(p).optim.lr
    assert lr == 3e-4 and type(lr) is float  # ...zoff reads it as the number it means


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"trian": {"max_steps": 5}}, "unknown key trian (did you mean 'train'?)"),
        ({"train": {"max_step": 5}}, "unknown key train.max_step (did you mean 'train.max_steps'?)"),
        (
            {"zero": {"offload_optimizer": {"devcie": "cpu"}}},
            "unknown key zero.offload_optimizer.devcie (did you mean 'zero.offload_optimizer.device'?)",
        ),
        ({"bogus": 1}, "unknown key bogus"),
        ({"train": {"max_steps": "abc"}}, "train.max_steps: expected an integer, got 'abc'"),
        ({"train": {"max_steps": True}}, "train.max_steps: expected an integer, got True"),
        ({"train": {"max_steps": [1]}}, "train.max_steps: expected an integer, got a list"),
        ({"train": {"max_steps": -1}}, "train.max_steps: must be >= 1, got -1"),
        ({"train": {"max_steps": 0}}, "train.max_steps: must be >= 1, got 0"),
        ({"zero": {"stage": 7}}, "zero.stage: must be <= 3, got 7"),
        ({"zero": {"stage": -1}}, "zero.stage: must be >= 0, got -1"),
        ({"optim": {"lr": 0}}, "optim.lr: must be > 0.0, got 0.0"),
        ({"optim": {"lr": float("nan")}}, "optim.lr: expected a finite number, got nan"),
        ({"optim": {"betas": [0.9]}}, "optim.betas: expected a list of 2 values, got [0.9]"),
        ({"optim": {"betas": [0.9, 1.0]}}, "optim.betas[1]: must be in [0, 1), got 1.0"),
        ({"optim": {"betas": [0.9, True]}}, "optim.betas[1]: expected a number, got True"),
        ({"train": {"precision": "fp8"}}, "train.precision: expected one of fp32, bf16, fp16, got 'fp8'"),
        (
            {"data": {"name": "synthetc"}},
            "data.name: expected one of stdlib-source, text, synthetic, jsonl, parquet, hf, got 'synthetc' (did you mean 'synthetic'?)",
        ),
        (
            {"zero": {"overlap_comm": "yes please"}},
            "zero.overlap_comm: expected true or false, got 'yes please'",
        ),
        ({"zero": {"overlap_comm": 1}}, "zero.overlap_comm: expected true or false, got 1"),
        ({"train": 5}, "train: expected a mapping, got int"),
        ({"model": {"args": [1]}}, "model.args: expected a mapping, got a list"),
        ({"launch": {"nproc_per_node": 0}}, "launch.nproc_per_node: must be >= 1, got 0"),
        (
            {"launch": {"nnodes": "3:1"}},
            "launch.nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '3:1'",
        ),
        ({"launch": {"nnodes": "0"}}, "launch.nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '0'"),
        (
            {"launch": {"nnodes": "1:2:3"}},
            "launch.nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got '1:2:3'",
        ),
        (
            {"launch": {"nnodes": "two"}},
            "launch.nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got 'two'",
        ),
        (
            {"data": {"seq_len": 256}, "model": {"seq_len": 128}},
            "data.seq_len: 256 exceeds the model's context model.seq_len (128)",
        ),
        ({"model": {"d_model": 30, "n_head": 4}}, "model.d_model: 30 must be divisible by model.n_head (4)"),
        (
            {"train": {"global_batch_size": 10}, "data": {"batch_size": 8}},
            "train.global_batch_size: 10 is not a multiple of data.batch_size (8)",
        ),
        (
            {"model": {"vocab_size": 100}},
            "model.vocab_size: 100 is too small for byte-level data (needs >= 256)",
        ),
        ({"data": {"name": "text"}}, "data.paths: data.name 'text' needs at least one file or glob"),
    ],
)
def test_validation_messages(raw, message):
    assert error_of(raw) == message


def test_valid_nnodes_forms(tmp_path):
    assert config_from_dict({"launch": {"nnodes": 2}}).launch.nnodes == "2"
    assert load_config(write(tmp_path, 'launch:\n  nnodes: "1:4"\n')).launch.nnodes == "1:4"


def test_gpt_only_checks_do_not_apply_to_user_factories():
    cfg = config_from_dict({"model": {"name": "python:pkg.mod:fn", "d_model": 30, "n_head": 4, "seq_len": 8}})
    assert cfg.model.d_model == 30


@pytest.mark.parametrize("text", ["nan", "inf"])
def test_nan_or_inf_written_as_a_word_is_rejected(text):
    assert error_of({"optim": {"lr": text}}) == f"optim.lr: expected a finite number, got '{text}'"


def test_top_level_must_be_a_mapping(tmp_path):
    p = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(info.value) == f"{p}: expected a mapping of sections at the top level, got a list"


def test_missing_file_names_the_file(tmp_path):
    p = tmp_path / "nope.yaml"
    with pytest.raises(UserError) as info:
        load_config(p)
    assert str(info.value) == f"{p}: config file not found"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = write(tmp_path, "train:\n  max_steps: 5\n bad: [1\nmodel: {}\n")
    with pytest.raises(UserError) as info:
        load_config(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: YAML syntax error (line 3, column ")
    assert "\n" not in msg


# ------------------------------------------------------------------------------------------- grad accum


def test_derive_grad_accum():
    assert derive_grad_accum(TrainConfig(grad_accum=3), micro_batch=4, world_size=2) == 3
    assert derive_grad_accum(TrainConfig(grad_accum=3, global_batch_size=32), 4, 2) == 4
    assert derive_grad_accum(TrainConfig(global_batch_size=32), 4, 8) == 1
    assert derive_grad_accum(TrainConfig(global_batch_size=32), 8, 1) == 4
    with pytest.raises(ConfigError) as info:
        derive_grad_accum(TrainConfig(global_batch_size=8), 4, 4)
    assert str(info.value) == (
        "train.global_batch_size: 8 is not divisible by data.batch_size x data-parallel ranks (4 x 4 = 16)"
    )


# ------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "source, overrides",
    [
        ({}, ()),
        ({"zero": "zero2-offload"}, ("zero.stage=3", "optim.betas=[0.8,0.9]", "optim.lr=1e-5")),
        ({"zero": "zero3-offload"}, ("launch.nnodes=2", "train.global_batch_size=64", "model.args.k=1")),
        ({"launch": {"nnodes": "1:4"}, "data": {"name": "text", "paths": ["a/*.txt", "b.txt"]}}, ()),
        *[(p, ()) for p in CONFIG_FILES],
    ],
    ids=lambda v: v.name if isinstance(v, Path) else None,
)
def test_resolved_config_round_trips(source, overrides):
    cfg = load_config(source, overrides) if isinstance(source, Path) else config_from_dict(source, overrides)
    text = dump_yaml(cfg)
    again = config_from_dict(yaml.safe_load(text))
    assert again == cfg
    assert dump_yaml(again) == text


def test_dump_has_every_section_fully_resolved():
    d = yaml.safe_load(dump_yaml(config_from_dict({"zero": "zero2-offload"})))
    assert list(d) == [f.name for f in dataclasses.fields(Config)]
    assert d["zero"] == {
        "recipe": "zero2-offload",
        "auto": False,
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "nvme_path": None,
            "allow_shared_path": False,
            "io": {"threads": 4, "request_mb": 8, "subgroup_mb": 96},
            "pin_memory": True,
            "staging_mb": 64,
            "grad_device": "auto",
            "host_budget": "auto",
            "overlap_step": False,
            "speculate": "auto",
            "delay_update": False,
            "delay_update_warmup": 0,
        },
        "offload_param": {
            "device": "none",
            "nvme_path": None,
            "io": {"threads": 4, "request_mb": 8},
            "pin_memory": True,
        },
        "overlap_comm": True,
        "reduce_bucket_size": 5_000_000,
        "allgather_bucket_size": 25_000_000,
        "prefetch_bucket_size": 3_000_000,
        "param_persistence_threshold": 10_000,
        "block_classes": [],
    }


# ---------------------------------------------------------------------------------------- shipped YAMLs


def test_there_are_shipped_configs_and_recipes():
    assert {p.stem for p in CONFIG_FILES} >= {"quickstart", "tiny"}
    assert {p.stem for p in RECIPE_FILES} >= set(SHIPPED_RECIPES)


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.name)
def test_every_recipe_loads_and_validates(path):
    raw = yaml.safe_load(path.read_text())
    assert list(raw) == ["zero"], "a recipe file holds exactly one `zero:` section"
    # the disk recipes leave the swap directory to the user (there is no safe default), as DeepSpeed's do
    where = ["zero.offload_optimizer.nvme_path=/var/tmp/zoff"] if "nvme" in path.stem else []
    cfg = config_from_dict({"zero": path.stem}, where)
    assert cfg.zero.recipe == path.stem
    # Whatever the recipe sets directly is what the resolved config holds.
    for key, value in raw["zero"].items():
        if key == "recipe":
            continue
        got = getattr(cfg.zero, key)
        if isinstance(value, dict):
            got = dataclasses.asdict(got)
            assert {k: got[k] for k in value} == value
        else:
            assert got == value


def header(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for line in lines:
        if not line.startswith("#"):
            break
        out.append(line)
    return out


@pytest.mark.parametrize("path", CONFIG_FILES + RECIPE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_yaml_starts_with_a_usage_header(path):
    head = header(path)
    assert len(head) >= 2, f"{path.name}: the file must start with a comment header"
    text = "\n".join(head)
    assert "zoff train" in text or "zero:" in text
    assert head[0].startswith(f"# {path.stem}") or path.stem in head[0]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_header_says_command_hardware_expected(path):
    head = header(path)
    for tag in ("# Command:", "# Hardware:", "# Expected:"):
        assert [line for line in head if line.startswith(tag)], f"{path.name}: no '{tag}' line in the header"
    (command,) = [line for line in head if line.startswith("# Command:")]
    assert re.search(rf"zoff train configs/{re.escape(path.name)}\b", command)
    (expected,) = [line for line in head if line.startswith("# Expected:")]
    assert re.search(r"loss", expected)


def test_grad_device_follows_the_optimizer():
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    assert config_from_dict(
        {"zero": {"stage": 2, "offload_optimizer": nvme}}
    ).zero.offload_optimizer.grads_on_disk
    dpu = config_from_dict({"zero": {"stage": 2, "offload_optimizer": {**nvme, "delay_update": True}}})
    assert dpu.zero.offload_optimizer.grads_on_disk  # two gradient files: the delayed step reads the other
    pinned = {**nvme, "delay_update": True, "grad_device": "cpu"}
    assert not config_from_dict(
        {"zero": {"stage": 2, "offload_optimizer": pinned}}
    ).zero.offload_optimizer.grads_on_disk
    with pytest.raises(ConfigError, match=r"^zero\.offload_optimizer\.grad_device: nvme needs"):
        config_from_dict(
            {"zero": {"stage": 2, "offload_optimizer": {"device": "cpu", "grad_device": "nvme"}}}
        )
