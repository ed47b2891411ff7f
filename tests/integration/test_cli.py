"""The `zoff` command line through the real entry point (`python -m zoff`): bad input, help, validate.

Each call is its own `python -m zoff` process: most are forked from the tests' fork server, which has imported zoff and torch
once (tests.forked_zoff), one of each kind of outcome starts a fresh interpreter (fresh=True).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.forked_zoff import forked_cli
from zoff.config import ZeroConfig, load_config, to_dict

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def zoff(
    *args: str | Path, cwd: Path | None = None, timeout: float = 120, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python -m zoff ARGS` in `cwd` (default: the repo), forked from the tests' fork server; fresh=True: a new
    interpreter."""
    cwd, env = cwd or REPO, _env()
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "zoff", *map(str, args)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return forked_cli([(list(args), cwd, env)], timeout)[0]


def assert_user_error(p: subprocess.CompletedProcess, *names: str) -> str:
    """Exit code 2, exactly one line on stderr, `zoff: error: ...` naming each of `names`; returns the line."""
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    (line,) = lines
    assert line.startswith("zoff: error: "), line
    for name in names:
        assert name in line, (name, line)
    return line


# ------------------------------------------------------------------------------------------- bad input


def test_missing_config_file(tmp_path):
    line = assert_user_error(zoff("validate", "nope.yaml", cwd=tmp_path, fresh=True), "nope.yaml")
    assert line == "zoff: error: nope.yaml: config file not found"
    assert_user_error(zoff("train", "nope.yaml", cwd=tmp_path), "nope.yaml", "not found")
    assert not (tmp_path / "runs").exists()


def test_activation_checkpointing_without_a_switch_is_refused_before_launch(tmp_path):
    p = zoff(
        "train", TINY, "model.name=python:tests.fixtures_models:tied_frozen", "train.activation_checkpointing=true",
        "--run-dir", tmp_path / "run",
    )  # fmt: skip
    line = assert_user_error(p, "train.activation_checkpointing", "TiedFrozen")
    assert "has no switch for it" in line
    assert not (tmp_path / "run").exists()


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    (tmp_path / "broken.yaml").write_text("train:\n  max_steps: 5\n bad: 1\n")
    line = assert_user_error(zoff("train", "broken.yaml", cwd=tmp_path), "broken.yaml", "YAML syntax error")
    assert line.startswith("zoff: error: broken.yaml: YAML syntax error (line 3, column ")
    assert not (tmp_path / "runs").exists()


def test_unknown_key_with_suggestion(tmp_path):
    (tmp_path / "c.yaml").write_text("trian:\n  max_steps: 5\n")
    line = assert_user_error(zoff("validate", "c.yaml", cwd=tmp_path))
    assert line == "zoff: error: unknown key trian (did you mean 'train'?)"


def test_unknown_nested_key_with_suggestion(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  max_step: 5\n")
    line = assert_user_error(zoff("train", "c.yaml", cwd=tmp_path))
    assert line == "zoff: error: unknown key train.max_step (did you mean 'train.max_steps'?)"
    assert not (tmp_path / "runs").exists()


def test_wrong_type():
    line = assert_user_error(zoff("validate", TINY, "train.max_steps=abc"))
    assert line == "zoff: error: train.max_steps: expected an integer, got 'abc'"


def test_negative_max_steps(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  max_steps: -5\n")
    line = assert_user_error(zoff("train", "c.yaml", cwd=tmp_path))
    assert line == "zoff: error: train.max_steps: must be >= 1, got -5"


def test_zero_stage_out_of_range():
    line = assert_user_error(zoff("validate", TINY, "zero.stage=7"))
    assert line == "zoff: error: zero.stage: must be <= 3, got 7"


def test_unknown_recipe():
    line = assert_user_error(zoff("validate", TINY, "zero.recipe=zero2-ofload"), "zero")
    assert line.startswith("zoff: error: zero: unknown recipe 'zero2-ofload' (did you mean 'zero2-offload'?)")


def test_override_of_a_nonexistent_key():
    line = assert_user_error(zoff("validate", TINY, "train.max_stepz=5"))
    assert line == (
        "zoff: error: override 'train.max_stepz=5': unknown key train.max_stepz (did you mean 'train.max_steps'?)"
    )


def test_override_without_equals():
    line = assert_user_error(zoff("validate", TINY, "train.max_steps"))
    assert line == "zoff: error: override 'train.max_steps': expected KEY.PATH=VALUE"


def test_nproc_per_node_zero(tmp_path):
    run = tmp_path / "run"
    line = assert_user_error(zoff("train", TINY, "--nproc-per-node", "0", "--run-dir", run))
    assert line == "zoff: error: launch.nproc_per_node: must be >= 1, got 0"
    assert not run.exists()


def test_unwritable_run_dir(tmp_path):
    (tmp_path / "afile").write_text("not a directory\n")
    line = assert_user_error(zoff("train", TINY, "--run-dir", tmp_path / "afile" / "run"), "--run-dir")
    assert line == f"zoff: error: --run-dir: cannot write to {tmp_path / 'afile' / 'run'}: Not a directory"


def test_bad_override_creates_no_run_directory(tmp_path):
    run = tmp_path / "X"
    assert_user_error(zoff("train", TINY, "--run-dir", run, "train.max_stepz=3"), "train.max_stepz")
    assert not run.exists()
    # Nor the default one under runs/.
    assert_user_error(zoff("train", TINY, "train.max_stepz=3", cwd=tmp_path), "train.max_stepz")
    assert not (tmp_path / "runs").exists()


def test_model_factory_that_cannot_be_imported_fails_before_any_run_directory(tmp_path):
    run = tmp_path / "X"
    line = assert_user_error(
        zoff("train", TINY, "--run-dir", run, "model.name=python:no_such_module_zoff:make"), "model.name"
    )
    assert "no_such_module_zoff" in line
    assert not run.exists()


def test_resume_from_a_missing_checkpoint_fails_before_any_run_directory(tmp_path):
    run = tmp_path / "X"
    line = assert_user_error(zoff("train", TINY, "--run-dir", run, "--resume", tmp_path / "no-such-ckpt"))
    assert line.startswith("zoff: error: --resume: ")
    assert not run.exists()


def test_convert_of_a_missing_checkpoint(tmp_path):
    ckpt, out = tmp_path / "no-such-ckpt", tmp_path / "out.safetensors"
    assert_user_error(zoff("convert", ckpt, out), str(ckpt))
    assert not out.exists()


def test_convert_errors_do_not_mention_resume(tmp_path):
    line = assert_user_error(zoff("convert", tmp_path / "no-such-ckpt", tmp_path / "out.safetensors"))
    assert "--resume" not in line


def test_option_of_the_wrong_type_is_one_line():
    line = assert_user_error(zoff("train", TINY, "--nproc-per-node", "abc"), "--nproc-per-node")
    assert line.startswith("zoff: error: ")


def test_option_of_the_wrong_type_exits_2_without_a_traceback():
    p = zoff("train", TINY, "--nproc-per-node", "abc", fresh=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "--nproc-per-node" in p.stderr


# ----------------------------------------------------------------------------------------------- help


def test_top_level_help_lists_the_commands():
    p = zoff("--help")
    assert p.returncode == 0, p.stderr
    for command in ("train", "validate", "estimate", "convert"):
        assert f"  {command} " in p.stdout, command


def test_train_help_lists_the_options():
    p = zoff("train", "--help")
    assert p.returncode == 0, p.stderr
    for option in (
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint",
        "--max-restarts",
        "--run-dir",
        "--resume",
    ):
        assert option in p.stdout, option
    assert "KEY.PATH=VALUE" in p.stdout


def test_validate_help():
    p = zoff("validate", "--help")
    assert p.returncode == 0, p.stderr
    assert "resolved config" in p.stdout
    assert "KEY.PATH=VALUE" in p.stdout


# ------------------------------------------------------------------------------------------- validate


@pytest.mark.slow  # imports torch for the preflight model build: ~5 s on 2 loaded cores
def test_validate_prints_the_resolved_config():
    p = zoff("validate", TINY, "train.max_steps=7", fresh=True)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    printed = yaml.safe_load(p.stdout)
    assert printed["train"]["max_steps"] == 7
    assert printed == to_dict(load_config(TINY, ["train.max_steps=7"]))
    # The zero section is fully resolved: the recipe is expanded and every key is present.
    assert printed["zero"]["recipe"] == "zero0"
    assert printed["zero"]["stage"] == 0
    assert printed["zero"] == {**to_dict(ZeroConfig()), "recipe": "zero0"}


@pytest.mark.slow  # imports torch for the preflight model build: ~5 s on 2 loaded cores
def test_validate_expands_an_inherited_recipe():
    p = zoff("validate", TINY, "zero.recipe=zero3-offload")
    assert p.returncode == 0, p.stderr
    z = yaml.safe_load(p.stdout)["zero"]
    assert z["recipe"] == "zero3-offload"
    assert z["stage"] == 3
    assert z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
