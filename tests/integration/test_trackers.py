"""Experiment trackers (issue 35 item 2), offline: a real `zoff train` with log.wandb (WANDB_MODE=offline) and
log.mlflow (a file store) logs the run's name and config, every number metrics.jsonl has at the same steps,
the plan's memory figures and the summary; resumed in the same run directory, it continues the same tracker
runs. Read back from wandb's offline run file and through MLflow's client."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked_zoff import zoff_run

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _train(tmp: Path, steps: int, *extra: str) -> None:
    env = {
        **os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true",
        "MLFLOW_TRACKING_URI": (tmp / "mlruns").as_uri(), "WANDB_DIR": str(tmp),
    }  # fmt: skip
    # forked (tests.forked_zoff): the ranks, which log, are new interpreters all the same
    p = zoff_run(
        ["train", str(REPO / "configs" / "tiny.yaml"), f"train.max_steps={steps}", "train.eval_every=2",
         "checkpoint.every_steps=2", "log.progress=false", "log.wandb=true", "log.mlflow=true",
         "log.project=zoff-test", "--run-dir", str(tmp / "run"), *extra],
        env=env, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]


def _wandb_records(path: Path) -> list:
    """The protobuf records of a wandb offline run file (a LevelDB-style log of 32 KiB blocks after a 7-byte
    header: each chunk is crc32, length, type (full, first, middle, last), data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            buf = chunk
        elif kind in (3, 4):
            buf += chunk
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
    return out


def _wandb_history(run_dir: Path) -> tuple[dict[int, dict], list]:
    rows, runs = {}, []
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for r in _wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":  # the step is in history.step, or an item "_step"
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                step = int(row["_step"]) if "_step" in row else int(r.history.step.num)
                rows.setdefault(step, {}).update(row)
            elif kind == "run":
                runs.append(r.run)
    return rows, runs


def _metrics(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            numbers = {
                k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            out.setdefault(rec["step"], {}).update({k: v for k, v in numbers.items() if k != "step"})
    return out


def test_both_trackers_log_every_metric_and_a_resume_continues_their_runs(
    tmp_path: Path, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores only when told to
    _train(tmp_path, 4)
    run_dir = tmp_path / "run"
    ids = json.loads((run_dir / "trackers.json").read_text())
    _train(tmp_path, 6, "--resume", "auto")
    assert json.loads((run_dir / "trackers.json").read_text()) == ids  # the same tracker runs, continued

    want = _metrics(run_dir)
    assert sorted(want) == [1, 2, 3, 4, 5, 6] and "val_loss" in want[2] and "loss" in want[6]
    rows, runs = _wandb_history(run_dir)
    assert {r.run_id for r in runs} == {ids["wandb"]} and len(runs) == 2  # two sessions of one run
    assert {r.display_name for r in runs} == {"run"} and {r.project for r in runs} == {"zoff-test"}
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in runs[0].config.update}
    assert config["train"]["max_steps"] == 4 and config["zero"]["stage"] == 0
    for step, rec in want.items():
        for key, value in rec.items():
            assert rows[step][key] == pytest.approx(value, rel=1e-12), (step, key)

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "run" and run.data.params["train.max_steps"] == "4"
    assert "plan/params_mib" in run.data.metrics
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        got = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], key)}
        assert got == pytest.approx({s: r[key] for s, r in want.items() if key in r}, rel=1e-12), key
    assert (
        json.loads(Path(client.download_artifacts(ids["mlflow"], "summary.json", str(tmp_path))).read_text())[
            "steps"
        ]
        == 6
    )


def test_a_tracker_that_is_not_installed_is_one_line(tmp_path: Path) -> None:
    """Its package hidden from the interpreter: named with its extra before anything starts."""
    (tmp_path / "mlflow.py").write_text("raise ImportError('hidden by the test')\n")
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "validate", str(REPO / "configs" / "tiny.yaml"), "log.mlflow=true"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "zoff: error: log.mlflow: needs the mlflow package (pip install zoff[mlflow])"
    ], p.stderr
