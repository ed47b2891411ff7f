"""`zoff convert` of LoRA checkpoints (model.lora) of a tiny Llama (and a GPT-2: transformers' Conv1D layers,
tied embeddings) trained from a model.path folder.

The checkpoint holds the adapters alone and names its base by checksum; `--format peft` writes what peft's own
save_pretrained writes and `PeftModel.from_pretrained` loads it; `--format hf --merge` is a plain Hugging Face
folder of the merged model; both give the trained model's logits (the reference: the base from the folder
wrapped by peft's get_peft_model, holding zoff's trained adapters). A full `--format safetensors` export reads
the frozen weights back from the base folder; a base folder that is gone or changed, and exports a checkpoint
does not allow, are one error line and exit 2. The CLI runs in this process (zoff.cli.main, as
test_convert's memory probe does): a subprocess per call would spend its time importing torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.harness import spawn, tiny_cfg, zoff_rank
from zoff.checkpoint.base_ref import weights_digest
from zoff.checkpoint.format import file_entry
from zoff.models.lora import base_name, is_adapter, resolve_targets

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LLAMA = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False, attn_implementation="sdpa",
)  # fmt: skip
GPT2 = dict(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
RUNS = ("stage2", "stage3-2ranks", "gpt2")  # the Llama at stage 2 (1 rank) and 3 (2 ranks), the GPT-2


# ------------------------------------------------------------------------------------------ helpers
def _jobs(rank: int, world: int, jobs: list[tuple[dict, str]]) -> list[dict]:
    """Several checkpointing runs one after the other in the same ranks (one process start-up)."""
    return [zoff_rank(rank, world, cfg, run_dir) for cfg, run_dir in jobs]


def _lora_cfg(base: Path, root: Path, zero: dict, cls: str = "LlamaForCausalLM") -> tuple[dict, str]:
    cfg = tiny_cfg(
        model={"name": f"hf:{cls}", "path": str(base), "lora": {"r": 4, "alpha": 8}},
        zero=zero,
        train={"max_steps": 3, "grad_accum": 1},
        optim={"lr": 3e-2},  # the adapters move visibly in 3 steps
        checkpoint={"dir": str(root / "ck")},
    )
    return cfg, str(root)


def _cli(*args) -> tuple[int, str]:
    """`zoff convert ARGS` through the command line's entry point: (exit code, stderr)."""
    import zoff.cli

    err, argv = io.StringIO(), sys.argv
    sys.argv = ["zoff", "convert", *map(str, args)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            zoff.cli.main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.argv = argv
    return code, err.getvalue()


def _ok(*args) -> None:
    code, err = _cli(*args)
    assert code == 0, err


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model.eval()(input_ids=_batch()).logits


def _base_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def _reference(folder: Path, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The base from its folder, wrapped by peft's get_peft_model, with zoff's trained adapter values."""
    base = _base_model(folder)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=resolve_targets(base, ["all-linear"]), task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: Conv1D needs fan_in_fan_out, which it sets (as for zoff)
        model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, value in params.items():
            model.get_parameter(f"base_model.model.{name}").copy_(value)
    return model


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A tiny Llama folder and LoRA runs from it at stage 2 (1 rank) and stage 3 (2 ranks); a tiny GPT-2 folder
    and a stage-2 LoRA run from it: 3 steps each, checkpointed; each run's step folder, its base folder and its
    trained (adapter) parameters. And 1-step checkpoints of the builtin GPT, plain and with an adapted lm_head."""
    root = tmp_path_factory.mktemp("lora-export")
    torch.manual_seed(11)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    llama.save_pretrained(str(root / "base"), safe_serialization=True)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    gpt2.save_pretrained(str(root / "base-gpt2"), safe_serialization=True)
    short = {"max_steps": 1, "grad_accum": 1}
    plain = tiny_cfg(train=short, checkpoint={"dir": str(root / "plain" / "ck")})
    tied_head = tiny_cfg(  # the builtin GPT's lm_head is its embedding: an adapter on it cannot be merged
        model={"lora": {"r": 4, "alpha": 8, "target_modules": ["lm_head"]}},
        train=short,
        checkpoint={"dir": str(root / "tied-head" / "ck")},
    )
    one = spawn(
        _jobs,
        1,
        [
            _lora_cfg(root / "base", root / "stage2", {"stage": 2}),
            _lora_cfg(root / "base-gpt2", root / "gpt2", {"stage": 2}, "GPT2LMHeadModel"),
            (plain, str(root / "plain")),
            (tied_head, str(root / "tied-head")),
        ],
    )[0]
    stage3 = {"stage": 3, "param_persistence_threshold": 64}  # the frozen base partitioned too
    two = spawn(_jobs, 2, [_lora_cfg(root / "base", root / "stage3-2ranks", stage3)])[0]
    step = lambda name, n=3: root / name / "ck" / f"step_{n:08d}"  # noqa: E731
    run = lambda name, base, result: {"step": step(name), "base": base, "params": result["params"]}  # noqa: E731
    return {
        "root": root,
        "plain": step("plain", 1),
        "tied-head": step("tied-head", 1),
        "stage2": run("stage2", root / "base", one[0]),
        "gpt2": run("gpt2", root / "base-gpt2", one[1]),
        "stage3-2ranks": run("stage3-2ranks", root / "base", two[0]),
    }


@pytest.fixture(scope="module")
def exports(trained) -> dict:
    """Each run's --format peft folder and merged hf folder, and the stage-2 run's full safetensors file."""
    out = trained["root"] / "exports"
    out.mkdir()
    for run in RUNS:
        _ok(trained[run]["step"], out / f"peft-{run}", "--format", "peft")
        _ok(trained[run]["step"], out / f"merged-{run}", "--format", "hf", "--merge")
    _ok(trained["stage2"]["step"], out / "full.safetensors")
    return {"out": out}


def _moved_base(trained, name: str, change) -> Path:
    """A copy of the stage-2 checkpoint whose config.yaml points model.path at a base folder `change` made."""
    ckpt = trained["root"] / f"ckpt-{name}"
    shutil.copytree(trained["stage2"]["step"], ckpt)
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["model"]["path"] = str(change(trained["root"] / f"base-{name}"))
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    manifest = json.loads((ckpt / "manifest.json").read_text())  # as if saved so: config.yaml is checksummed
    manifest["files"].update(file_entry(ckpt / "config.yaml"))
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def _changed_copy(trained):
    def change(folder: Path) -> Path:
        shutil.copytree(trained["stage2"]["base"], folder)
        weights = load_file(str(folder / "model.safetensors"))
        weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    return change


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------------ the checkpoint
@pytest.mark.parametrize("run", RUNS)
def test_checkpoint_holds_adapters_only_and_names_its_base(trained, run) -> None:
    step, base = trained[run]["step"], trained[run]["base"]
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["base"] == {"path": str(base.resolve()), "sha256": weights_digest(base)}
    saved = [n for p in manifest["params"] for n in p["names"]]
    assert saved and all(is_adapter(n) for n in saved), [n for n in saved if not is_adapter(n)]
    assert sorted(saved) == sorted(trained[run]["params"])
    assert not any(p.get("frozen") for p in manifest["params"])
    assert not list(step.glob("frozen_*")), "stage 3's frozen shards are the base's: not saved"
    base_keys = set(_stored(base))
    extra = set(load_file(str(step / "extra.safetensors")))
    assert not {base_name(k) for k in extra} & base_keys, extra
    # the shard files hold the adapters' masters (and their Adam moments): not one element of the base
    masters = 0
    for shard in step.glob("shard_*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            masters += sum(f.get_slice(k).get_shape()[0] for k in f.keys() if k.endswith(".master"))
    assert masters == sum(v.numel() for v in trained[run]["params"].values())
    # every key of the model's state_dict is still listed (GPT-2's tied lm_head too, which the folder
    # stores once, as wte): convert reads the frozen ones from the base
    listed = {base_name(k) for k in manifest["state_dict_keys"] if not is_adapter(k)}
    assert listed - base_keys == ({"lm_head.weight"} if run == "gpt2" else set())
    assert base_keys <= listed


# ------------------------------------------------------------------------------------------ exports
@pytest.mark.parametrize("run", RUNS)
def test_peft_folder_loads_in_peft_with_the_trained_logits(trained, exports, run) -> None:
    out, params, base = exports["out"] / f"peft-{run}", trained[run]["params"], trained[run]["base"]
    loaded = peft.PeftModel.from_pretrained(_base_model(base), str(out))
    reference = _reference(base, params)
    want = _logits(reference)
    assert not torch.allclose(want, _logits(_base_model(base)), atol=1e-3)  # the adapters matter
    torch.testing.assert_close(_logits(loaded), want, atol=1e-5, rtol=0)
    # the files are the ones peft's own save_pretrained writes for the same model
    ours = load_file(str(out / "adapter_model.safetensors"))
    theirs_dir = trained["root"] / f"peft-save-pretrained-{run}"
    reference.save_pretrained(str(theirs_dir))
    theirs = load_file(str(theirs_dir / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], value), key
    config, want_config = (json.loads((d / "adapter_config.json").read_text()) for d in (out, theirs_dir))
    assert set(config.pop("target_modules")) == set(want_config.pop("target_modules"))
    assert config == want_config
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert config["task_type"] == "CAUSAL_LM" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["fan_in_fan_out"] == (run == "gpt2")  # Conv1D keeps its weight transposed


@pytest.mark.parametrize("run", RUNS)
def test_merged_hf_folder_has_the_trained_logits(trained, exports, run) -> None:
    out, base = exports["out"] / f"merged-{run}", trained[run]["base"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(merged) is type(_base_model(base))
    stored = _stored(out)
    assert set(stored) == set(_stored(base))  # the base's own names (GPT-2's tied lm_head: stored once)
    reference = _reference(base, trained[run]["params"])
    torch.testing.assert_close(_logits(merged), _logits(reference), atol=1e-5, rtol=0)
    peft_logits = _logits(peft.PeftModel.from_pretrained(_base_model(base), exports["out"] / f"peft-{run}"))
    torch.testing.assert_close(_logits(merged), peft_logits, atol=1e-5, rtol=0)
    # merged: W + (alpha / r) B A (transposed for Conv1D), what peft's merge_and_unload gives
    want = reference.merge_and_unload().state_dict()
    for key, value in stored.items():
        torch.testing.assert_close(value, want[key], atol=1e-6, rtol=0, msg=key)


def test_full_export_reads_the_frozen_weights_from_the_base(trained, exports) -> None:
    sd = load_file(str(exports["out"] / "full.safetensors"))
    manifest = json.loads((trained["stage2"]["step"] / "manifest.json").read_text())
    assert set(sd) == set(manifest["state_dict_keys"])  # the adapted model's state_dict, base_layer names
    base = _stored(trained["stage2"]["base"])
    for key, value in sd.items():
        if is_adapter(key):
            assert torch.equal(value, trained["stage2"]["params"][key]), key
        else:
            assert torch.equal(value, base[base_name(key)].float()), key


def test_peft_export_needs_no_base_folder(trained, exports) -> None:
    """The adapters alone: with the base folder gone, the structure comes from the config.json the
    checkpoint carries (here in bf16)."""
    ckpt = _moved_base(trained, "gone", lambda folder: folder)  # points at a folder that does not exist
    out = trained["root"] / "peft-without-base"
    _ok(ckpt, out, "--format", "peft", "--dtype", "bf16")
    got = load_file(str(out / "adapter_model.safetensors"))
    want = load_file(str(exports["out"] / "peft-stage2" / "adapter_model.safetensors"))  # fp32
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, want[key].to(torch.bfloat16)), key


def test_a_moved_base_is_named_with_the_base_flag(trained, exports) -> None:
    """The base folder moved after training: --base names where it is now (its checksum still checked), and
    the exports are those made from the original folder; the peft folder points at the new place."""
    ckpt = _moved_base(trained, "moved", lambda folder: folder)  # config.yaml names a folder that is gone
    moved = trained["root"] / "base-relocated"
    shutil.copytree(trained["stage2"]["base"], moved)
    merged, adapters = trained["root"] / "merged-moved", trained["root"] / "peft-moved"
    _ok(ckpt, merged, "--format", "hf", "--merge", "--base", moved)
    _ok(ckpt, adapters, "--format", "peft", "--base", moved)
    want = _stored(exports["out"] / "merged-stage2")
    got = _stored(merged)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(moved.resolve())


# ------------------------------------------------------------------------------------------ bad requests
ERRORS = {  # case -> substrings of the one error line
    "peft-of-plain-checkpoint": ["--format peft needs a checkpoint trained with model.lora"],
    "merge-of-plain-checkpoint": ["--merge needs a checkpoint trained with model.lora"],
    "hf-without-merge": ["--format hf", "LoRA adapters", "--format peft", "--merge"],
    "peft-with-merge": ["--merge", "--format peft"],
    "merge-of-tied-head": ["--merge", "'lm_head.weight' is tied to 'wte.weight'", "--format peft"],
    "base-changed": ["base-changed", "other weights"],
    "base-gone": ["base-gone", "does not exist", "--base PATH"],
    "base-flag-changed": ["--base: ", "base-flag-changed", "other weights"],
    "base-flag-not-a-model-folder": ["--base", "no config.json"],
    "base-flag-on-plain-checkpoint": ["--base", "was not trained from a model.path folder"],
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_request_is_one_line_exit_2(trained, case) -> None:
    lora, plain = trained["stage2"]["step"], trained["plain"]
    args = {  # built on demand: the base-folder cases copy the checkpoint
        "peft-of-plain-checkpoint": lambda: [plain, "--format", "peft"],
        "merge-of-plain-checkpoint": lambda: [plain, "--merge"],
        "hf-without-merge": lambda: [lora, "--format", "hf"],
        "peft-with-merge": lambda: [lora, "--format", "peft", "--merge"],
        "merge-of-tied-head": lambda: [trained["tied-head"], "--merge"],
        "base-changed": lambda: [
            _moved_base(trained, "changed", _changed_copy(trained)),
            "--format",
            "hf",
            "--merge",
        ],
        "base-gone": lambda: [_moved_base(trained, "gone-full", lambda folder: folder)],
        "base-flag-changed": lambda: [
            _moved_base(trained, "gone-changed", lambda folder: folder),
            "--base",
            _changed_copy(trained)(trained["root"] / "base-flag-changed"),
        ],
        "base-flag-not-a-model-folder": lambda: [lora, "--base", trained["root"]],
        "base-flag-on-plain-checkpoint": lambda: [plain, "--base", trained["stage2"]["base"]],
    }[case]()
    out = trained["root"] / f"out-{case}"
    code, err = _cli(args[0], out, *args[1:])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zoff: error: "), (code, err)
    for part in ERRORS[case]:
        assert part in lines[0], (part, lines[0])
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp"))
