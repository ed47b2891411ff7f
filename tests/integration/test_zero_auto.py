"""`zero: auto`: zoff train picks the policy `zoff estimate --suggest` would, says why, and runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zoff.config import load_config
from zoff.planning.estimate import detect_budget
from zoff.planning.memory import resolve_auto

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_with_zero_auto_runs_the_chosen_policy(tmp_path: Path) -> None:
    overrides = ["zero=auto", "train.max_steps=2"]
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    budget, device = detect_budget(None, None)
    want = resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, 2, budget.gpu, budget.cpu,
                        local_ranks=2, shared=budget.shared, device_type=device)  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "train", "configs/tiny.yaml", "--run-dir", str(tmp_path), *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert f"zero: auto chose stage {want[0]}, offload optimizer {want[1]}, params {want[2]}" in p.stdout
    assert want[4] in p.stdout  # the reason
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["zero"]
    assert (saved["stage"], saved["offload_optimizer"]["device"], saved["auto"]) == (want[0], want[1], False)
    assert f"ZeRO stage {want[0]}" in (tmp_path / "logs" / "rank0.log").read_text()


def test_zero_auto_is_a_config_value() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["zero=auto"])
    assert cfg.zero.auto and cfg.zero.recipe is None
