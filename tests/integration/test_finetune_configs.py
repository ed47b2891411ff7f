"""The shipped fine-tuning configs run end to end as a newcomer runs them: `scripts/make_finetune_data.py` writes
the tiny random base, `zoff train configs/llama-sft.yaml` and `configs/llama-lora.yaml` train through the real
elastic launcher with their loss falling, and the LoRA run's checkpoint exports as a peft adapter folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Steps 1-8 are all warmup (warmup_steps 10 in both configs), so their losses do not depend on max_steps.
# llama-sft falls from 7.36 at step 1 to a mean of 6.96 over steps 5-8, 0.39, twice the 0.2 asked (12 steps:
# 0.72). llama-lora (in the grid) learns more slowly, 0.24 by step 8: it keeps its 12.
STEPS = {"llama-sft": 8, "llama-lora": 12}


def zoff(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    p = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The script's output in a scratch folder (the shipped chat.jsonl copied in, the model written anew)."""
    out = tmp_path_factory.mktemp("finetune")
    (out / "chat.jsonl").write_bytes((REPO / "examples" / "finetune" / "chat.jsonl").read_bytes())
    zoff("scripts/make_finetune_data.py", "--out", str(out))
    return out


def _train(config: str, base: Path, run_dir: Path) -> list[dict]:
    zoff(
        "-m", "zoff", "train", f"configs/{config}.yaml", "--run-dir", str(run_dir),
        f"model.path={base / 'tiny-llama'}", f"data.tokenizer={base / 'tiny-llama'}",
        f"data.paths=[{base / 'chat.jsonl'}]", f"train.max_steps={STEPS[config]}", "train.log_every=1",
    )  # fmt: skip
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# llama-lora (25 s) runs with -m grid: LoRA training, its checkpoint and the adapter export are in the default
# suite through test_lora.py, test_lora_export.py and test_finetune_resume.py (the default suite's budget).
@pytest.mark.parametrize("config", ["llama-sft", pytest.param("llama-lora", marks=pytest.mark.grid)])
def test_shipped_finetune_config_trains(config: str, base: Path, tmp_path: Path) -> None:
    records = _train(config, base, tmp_path / "run")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS[config]
    assert sum(losses[-4:]) / 4 < losses[0] - 0.2  # learning, not noise
    for r in (r for r in records if "loss" in r):  # the answers' tokens, not the padding and prompts
        processed = r["tokens_per_s"] * r["step_time_s"]
        assert 0 < r["trained_tokens"] < processed
        assert r["trained_tokens_per_s"] == pytest.approx(r["trained_tokens"] / r["step_time_s"])
    if config == "llama-lora":
        ckpt = next((tmp_path / "run" / "checkpoints").glob("step_*"))
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["base"]["path"] == str((base / "tiny-llama").resolve())
        assert all(".lora_" in n for p in manifest["params"] for n in p["names"])  # adapters only
        out = tmp_path / "adapter"
        zoff("-m", "zoff", "convert", str(tmp_path / "run" / "checkpoints"), str(out), "--format", "peft")
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in out.iterdir()}
