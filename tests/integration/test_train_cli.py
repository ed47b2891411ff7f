"""End to end: `python -m zoff train configs/tiny.yaml` through the real elastic launcher (gloo, CPU)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.forked_zoff import zoff_run
from zoff.config import config_from_dict, dump_yaml, load_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
STEPS = 6
OVERRIDES = (f"train.max_steps={STEPS}", "train.log_every=1")
STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}


def train(
    run_dir: Path, *args: str, timeout: float = 180, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`zoff train configs/tiny.yaml --run-dir RUN_DIR *args`, from the repo root, `tests` importable; forked
    from the tests' fork server unless `fresh` (tests.forked_zoff.zoff_run)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # (the timeout: a hung launcher fails the test instead of the suite)
    argv = ["train", str(TINY), "--run-dir", str(run_dir), *args]
    return zoff_run(argv, cwd=REPO, env=env, timeout=timeout, fresh=fresh)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def run2(tmp_path_factory) -> Path:
    """One 2-rank run shared by the tests that only inspect its outputs."""
    run_dir = tmp_path_factory.mktemp("train2") / "run"
    ok(train(run_dir, *OVERRIDES, fresh=True))  # (a new interpreter for one successful run)
    return run_dir


def test_two_rank_run_writes_the_resolved_config(run2):
    text = (run2 / "config.yaml").read_text()
    resolved = load_config(TINY, list(OVERRIDES))
    assert text == dump_yaml(resolved)  # exactly what `zoff validate` prints for the same arguments
    assert config_from_dict(yaml.safe_load(text)) == resolved
    assert resolved.launch.nproc_per_node == 2 and resolved.train.max_steps == STEPS


def test_two_rank_run_writes_one_metrics_record_per_step_then_val_loss(run2):
    recs = records(run2)
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert STEP_KEYS <= set(r), r
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in STEP_KEYS), r
        assert r["lr"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
    # A byte-level model starts near ln(256) = 5.55.
    assert abs(steps[0]["loss"] - math.log(256)) < 0.5
    assert recs[-1].keys() == {"step", "val_loss"}
    assert recs[-1]["step"] == STEPS and math.isfinite(recs[-1]["val_loss"])
    assert [r for r in recs if "val_loss" in r] == [recs[-1]]  # tiny.yaml evaluates only at the end


def test_two_rank_run_writes_a_log_per_rank(run2):
    for rank in (0, 1):
        log = run2 / "logs" / f"rank{rank}.log"
        assert log.is_file(), log
        assert f"rank{rank} zoff plan: world size 2 (gloo)" in log.read_text()
    assert not (run2 / "logs" / "rank2.log").exists()


def test_same_config_and_seed_give_identical_losses(run2, tmp_path):
    again = tmp_path / "again"
    ok(train(again, *OVERRIDES))
    first, second = records(run2), records(again)
    assert [r.get("loss") for r in second] == [r.get("loss") for r in first]  # bit-identical floats
    assert [r.get("val_loss") for r in second] == [r.get("val_loss") for r in first]
    assert [r.get("grad_norm") for r in second] == [r.get("grad_norm") for r in first]


@pytest.fixture(scope="module")
def run1(tmp_path_factory) -> Path:
    """--nproc-per-node 1 with the 2-rank run's global batch (2 micro-batches of 4 on one rank)."""
    run_dir = tmp_path_factory.mktemp("train1") / "run"
    ok(train(run_dir, "--nproc-per-node", "1", *OVERRIDES, "train.global_batch_size=8"))
    return run_dir


def test_one_rank_run_works(run1):
    saved = yaml.safe_load((run1 / "config.yaml").read_text())
    assert saved["launch"]["nproc_per_node"] == 1 and saved["train"]["global_batch_size"] == 8
    assert (run1 / "logs" / "rank0.log").is_file() and not (run1 / "logs" / "rank1.log").exists()
    assert "rank0 zoff plan: world size 1 (gloo)" in (run1 / "logs" / "rank0.log").read_text()
    assert [r["step"] for r in step_records(run1)] == list(range(1, STEPS + 1))
    assert "val_loss" in records(run1)[-1]


def test_one_rank_run_sees_the_same_global_batches_as_two_ranks(run1, run2):
    """Same global batch, other world size: same samples, so the same loss curve up to summation order."""
    losses_1 = [r["loss"] for r in step_records(run1)]
    losses_2 = [r["loss"] for r in step_records(run2)]
    assert losses_1 == pytest.approx(losses_2, rel=1e-5)


def test_val_loss_does_not_depend_on_the_world_size(run1, run2):
    assert records(run1)[-1]["val_loss"] == pytest.approx(records(run2)[-1]["val_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def boom_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run whose model factory raises RuntimeError("boom") inside the workers (not in the CLI's preflight)."""
    run_dir = tmp_path_factory.mktemp("boom") / "run"
    p = train(run_dir, *OVERRIDES, "model.name=python:tests.fixtures_models:boom", timeout=120)
    return run_dir, p


def test_worker_failure_exits_nonzero_and_shows_the_error(boom_run):
    run_dir, p = boom_run  # returning at all (within the timeout) means the launcher did not hang
    assert p.returncode not in (0, 2), (p.returncode, p.stderr)  # a training failure, not a usage error
    assert "RuntimeError: boom" in p.stderr, p.stderr
    assert (run_dir / "config.yaml").is_file()
    assert not (run_dir / "metrics.jsonl").exists()


def test_worker_failure_is_reported_by_zoff(boom_run):
    run_dir, p = boom_run
    assert "AttributeError" not in p.stderr
    assert p.returncode == 1
    assert re.search(r"zoff: training failed: rank [01] failed \(exit code 1\): RuntimeError: boom", p.stderr)
    assert f"zoff: per-rank logs are in {run_dir / 'logs'}" in p.stderr


def test_plan_and_summary_compare_model_states_with_plain_data_parallelism(run2):
    """The first run shows what ZeRO saved: the allocated model states per rank against DDP's 16 B/param."""
    cfg = load_config(TINY, list(OVERRIDES))
    summary = json.loads((run2 / "summary.json").read_text())
    held, ddp = summary["model_state_mib_per_rank"], summary["ddp_model_state_mib_per_rank"]
    log = (run2 / "logs" / "rank0.log").read_text()
    assert f"against {ddp:,.1f} MiB under plain data parallelism" in log
    assert f"= {held:,.1f} MiB of model states" in log
    assert cfg.zero.stage == 0  # tiny.yaml is plain data parallelism: the two figures agree (padding aside)
    assert held == pytest.approx(ddp, rel=0.01)
    # every rank's peak RSS, and the summary's is the largest (it was rank 0's alone)
    peaks = summary["peak_rss_mib_per_rank"]
    assert len(peaks) == 2 and all(x > 50 for x in peaks) and summary["peak_rss_mib"] == max(peaks)
    # each step's record: the largest rank's peak so far, and which rank that was
    records = [json.loads(line) for line in (run2 / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    assert steps and all(r["peak_rss_rank"] in (0, 1) for r in steps)
    assert all(50 < r["peak_rss_mib"] <= summary["peak_rss_mib"] for r in steps)


def test_a_torch_older_than_the_launcher_needs_is_one_line(tmp_path, monkeypatch):
    """torch < 2.11: its elastic LaunchConfig has no signals_to_handle; zoff says so instead of a TypeError."""
    import dataclasses

    import zoff.cli
    import zoff.launch.elastic
    from zoff.errors import UserError

    @dataclasses.dataclass
    class OldLaunchConfig:  # torch 2.6's fields, in part: no shutdown_timeout, no signals_to_handle
        min_nodes: int
        max_nodes: int
        nproc_per_node: int

    monkeypatch.setattr(zoff.launch.elastic, "ElasticConfig", OldLaunchConfig)
    with pytest.raises(UserError, match=r"zoff needs torch 2\.11 or later \(this is "):
        zoff.launch.elastic.launch(config_from_dict({}), tmp_path)
    # zoff train checks it before the run directory is made
    monkeypatch.setattr(
        sys,
        "argv",
        ["zoff", "train", str(REPO / "configs" / "tiny.yaml"), "--run-dir", str(tmp_path / "run")],
    )
    with pytest.raises(SystemExit) as exited:
        zoff.cli.main()
    assert exited.value.code == 2 and not (tmp_path / "run").exists()


def test_torch_2_11_stop_grace_is_said_at_start(monkeypatch):
    """torch 2.11's launcher has no shutdown_timeout: a stop gets its fixed 30 s, and the start-up says so."""
    import dataclasses

    import zoff.launch.elastic

    @dataclasses.dataclass
    class LaunchConfig211:  # torch 2.11: signals_to_handle, no shutdown_timeout
        min_nodes: int
        signals_to_handle: str = ""

    lc = config_from_dict({"launch": {"shutdown_timeout_s": 300}}).launch
    assert zoff.launch.elastic.stop_grace_note(lc) is None  # this torch honours the setting
    monkeypatch.setattr(zoff.launch.elastic, "ElasticConfig", LaunchConfig211)
    zoff.launch.elastic.check_torch()  # accepted
    note = zoff.launch.elastic.stop_grace_note(lc)
    assert note and "30 s to checkpoint before SIGKILL, not launch.shutdown_timeout_s=300" in note
    assert (
        zoff.launch.elastic.stop_grace_note(config_from_dict({"launch": {"shutdown_timeout_s": 20}}).launch)
        is None
    )
