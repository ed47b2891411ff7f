"""`zero: auto`: zoff train picks the policy `zoff estimate --suggest` would, says why, and runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.forked_zoff import zoff_run
from zoff.config import load_config
from zoff.planning.choice import resolve_auto
from zoff.planning.estimate import detect_budget

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_with_zero_auto_runs_the_chosen_policy(tmp_path: Path) -> None:
    overrides = ["zero=auto", "train.max_steps=2"]
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    budget, device = detect_budget(None, None)
    want = resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, 2, budget.gpu, budget.cpu,
                        local_ranks=2, shared=budget.shared, device_type=device)  # fmt: skip
    p = zoff_run(["train", "configs/tiny.yaml", "--run-dir", str(tmp_path), *overrides], cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert f"zero: auto chose stage {want[0]}, offload optimizer {want[1]}, params {want[2]}" in p.stdout
    assert want[4] in p.stdout  # the reason
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["zero"]
    assert (saved["stage"], saved["offload_optimizer"]["device"], saved["auto"]) == (want[0], want[1], False)
    assert f"ZeRO stage {want[0]}" in (tmp_path / "logs" / "rank0.log").read_text()


def test_zero_auto_is_a_config_value() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["zero=auto"])
    assert cfg.zero.auto and cfg.zero.recipe is None


def test_zero_auto_keeps_block_inputs_in_host_memory_when_nothing_fits_without(monkeypatch) -> None:
    """configs/gpt-7b.yaml at 64K tokens (one sequence, tiled loss) on one 24 GiB GPU with 256 GiB of RAM: no
    policy fits with the inputs of checkpointed blocks on the GPU; with train.activation_offload (bit for bit
    the same results) zero3-offload does, and auto says so. Where even that does not fit, the first error."""
    from zoff.errors import UserError
    from zoff.planning import estimate as E
    from zoff.planning.memory import Budget

    gib = 2**30
    box = Budget(24 * gib, 256 * gib)
    monkeypatch.setattr(E, "detect_budget", lambda gpu, cpu: (box, "cuda"))
    overrides = ["zero=auto", "data.batch_size=1", "model.seq_len=65536", "data.seq_len=65536",
                 "train.loss_tile=4096", "launch.nproc_per_node=1"]  # fmt: skip
    cfg = load_config(REPO / "configs" / "gpt-7b.yaml", overrides)
    with pytest.raises(UserError):
        resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, 1, box.gpu, box.cpu)
    chosen, why = E.choose_policy(cfg)
    assert chosen.train.activation_offload and chosen.train.activation_checkpointing
    assert (chosen.zero.stage, chosen.zero.offload_param.device) == (3, "cpu")
    assert "with its inputs in host memory (train.activation_offload: nothing fits without)" in why
    too_long = load_config(REPO / "configs" / "gpt-7b.yaml", [*overrides[:2], "model.seq_len=262144",
                                                              "data.seq_len=262144", *overrides[4:]])  # fmt: skip
    with pytest.raises(UserError, match="zero: auto: "):
        E.choose_policy(too_long)


def test_zero_auto_writes_the_gathering_that_makes_stage3_fit(monkeypatch) -> None:
    """configs/gpt-70b.yaml on 16 x 80 GiB: stage 3 fits without offload only with each Linear gathered alone
    (memory.fit_gathering); auto picks it, writes zero.block_classes into the config and says so."""
    from zoff.planning import estimate as E
    from zoff.planning.memory import Budget

    gib = 2**30
    monkeypatch.setattr(E, "detect_budget", lambda gpu, cpu: (Budget(80 * gib, 1024 * gib), "cuda"))
    cfg = load_config(REPO / "configs" / "gpt-70b.yaml", ["zero=auto", "launch.nproc_per_node=16"])
    chosen, why = E.choose_policy(cfg)
    assert (chosen.zero.stage, chosen.zero.offload_optimizer.device) == (3, "none")
    assert chosen.zero.block_classes == ["Linear"] and chosen.zero.overlap_comm
    assert "with zero.block_classes: [Linear]" in why
