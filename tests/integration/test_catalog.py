"""`zoff ls` / `zoff cp`, and every shipped config validates and builds (hf: ones included)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoff.config import CONFIGS_DIR, RECIPES_DIR, load_config
from zoff.config.catalog import describe, entries
from zoff.data import preflight
from zoff.models import build_model

REPO = Path(__file__).resolve().parents[2]


def zoff(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zoff", *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env
    )


def test_ls_lists_every_config_and_recipe_with_its_header_line():
    p = zoff("ls")
    assert p.returncode == 0, p.stderr
    shipped = sorted(CONFIGS_DIR.glob("*.yaml")) + sorted(RECIPES_DIR.glob("*.yaml"))
    assert {e.path for e in entries()} == set(shipped)
    for path in shipped:
        desc = describe(path)
        assert desc and not desc.startswith("#")
        assert any(line.split() == [path.stem, *desc.split()] for line in p.stdout.splitlines()), path.name
    assert describe(CONFIGS_DIR / "llama-tiny.yaml").startswith("a 0.8M-parameter Llama-style")


def test_cp_copies_and_never_overwrites(tmp_path):
    p = zoff("cp", "llama-tiny", str(tmp_path))
    assert p.returncode == 0, p.stderr
    copied = tmp_path / "llama-tiny.yaml"
    assert copied.read_text() == (CONFIGS_DIR / "llama-tiny.yaml").read_text()
    copied.write_text("# edited\n")
    p = zoff("cp", "llama-tiny", str(tmp_path))
    assert p.returncode == 2
    assert (
        p.stderr.strip()
        == f"zoff: error: {copied}: already exists (zoff cp never overwrites; choose another DEST)"
    )
    assert copied.read_text() == "# edited\n"
    assert zoff("cp", "recipes/zero2-offload.yaml", str(tmp_path / "mine.yaml")).returncode == 0
    assert (tmp_path / "mine.yaml").read_text() == (RECIPES_DIR / "zero2-offload.yaml").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("cp", "quickstrat", "x.yaml"),
            "NAME: no shipped config or recipe 'quickstrat' (did you mean 'quickstart'?)",
        ),
        (("cp", "tiny", "no/such/dir/x.yaml"), "DEST: its folder no/such/dir does not exist"),
    ],
)
def test_cp_errors_are_one_line(tmp_path, args, message):
    p = zoff(*args, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == f"zoff: error: {message}"


@pytest.fixture(scope="module")
def finetune_example(tmp_path_factory) -> Path:
    """What `python scripts/make_finetune_data.py` writes (the fine-tuning configs' base is not in git)."""
    out = tmp_path_factory.mktemp("finetune")
    shutil.copy(REPO / "examples" / "finetune" / "chat.jsonl", out / "chat.jsonl")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_finetune_data.py"), "--out", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_and_builds(path, request):
    # (its header's Command/Hardware/Expected lines: tests/unit/test_config.py)
    cfg = load_config(path)
    if cfg.model.name.startswith("hf:"):
        pytest.importorskip("transformers")
    if cfg.model.path == "examples/finetune/tiny-llama":  # written by its script, as the header says
        pytest.importorskip("peft")
        base = request.getfixturevalue("finetune_example")
        cfg = load_config(
            path,
            [f"model.path={base / 'tiny-llama'}", f"data.tokenizer={base / 'tiny-llama'}",
             f"data.paths=[{base / 'chat.jsonl'}]"],
        )  # fmt: skip
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > 0
    preflight(cfg.data)


def test_shipped_hf_config_without_transformers_is_a_one_line_error(tmp_path):
    fake = tmp_path / "fake" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
    p = zoff(
        "validate", str(CONFIGS_DIR / "llama-tiny.yaml"), env={"PYTHONPATH": str(fake.parent), "PATH": ""}
    )
    assert p.returncode == 2
    assert p.stderr.strip() == "zoff: error: model.name: hf: models need transformers: pip install zoff[hf]"
