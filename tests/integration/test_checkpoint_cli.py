"""Checkpoints through the real CLI (`python -m zoff train configs/tiny.yaml`, 2 ranks over gloo).

One scenario in one run directory, the way a user meets it, shared by the tests below:
1. `--resume auto` with no checkpoint yet: starts fresh, trains 2 steps, saves step 2.
2. `--resume auto` to 6 steps with the save paused at step 4 (tests/inject/sitecustomize.py): SIGKILL rank 1 while
   the step-4 save is half written; the launcher fails.
3. `--resume auto` again: continues from step 2 to step 6; keep_last=2 leaves steps 4 and 6.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import descendants
from zoff.checkpoint.format import find_checkpoint, read_manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
RESUMED_FROM_2 = re.compile(
    r"zoff: resum\w* (from|at) step 2\b"
)  # "resumed from step 2" / "resume at step 2"
CKPT = ("checkpoint.every_steps=2", "checkpoint.keep_last=2", "train.log_every=1")
PAUSE_S = 3  # the step-4 save's pause (tests/inject/sitecustomize.py), in seconds


def _env(**extra: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env = {k: v for k, v in env.items() if not k.startswith("ZOFF_TEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}


def _argv(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "zoff", "train", str(TINY), "--run-dir", str(run_dir), *args]


def train(run_dir: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        _argv(run_dir, *args), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p


def step_records(text: str) -> list[dict]:
    return [r for r in map(json.loads, text.splitlines()) if "loss" in r]


def rank_of(pid: int, run_dir: Path) -> int | None:
    """The zoff rank a process is: the one holding <run_dir>/logs/rank<r>.log open (its environ shows the
    launcher's environment only; the elastic agent sets RANK inside the spawned child)."""
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.parent == run_dir / "logs" and target.name.startswith("rank") and target.suffix == ".log":
            return int(target.stem[len("rank") :])
    return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def snapshot(ckpt_dir: Path) -> dict:
    """What `--resume auto` would see now."""
    found = find_checkpoint("auto", ckpt_dir)
    try:
        verified = read_manifest(found, verify=True)["step"] if found else None
    except Exception as e:  # recorded, asserted by the tests
        verified = repr(e)
    return {
        "entries": sorted(p.name for p in ckpt_dir.iterdir()),
        "latest": (ckpt_dir / "latest").read_text().strip(),
        "found": found,
        "verified_step": verified,
    }


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt-cli")
    run_dir, ckpt_dir, flag = root / "run", root / "run" / "checkpoints", root / "paused.flag"
    s: dict = {"root": root, "run_dir": run_dir, "ckpt_dir": ckpt_dir}

    # 1. fresh start through --resume auto
    s["first"] = ok(train(run_dir, "--resume", "auto", "train.max_steps=2", *CKPT))
    s["metrics_after_first"] = (run_dir / "metrics.jsonl").read_text()

    # 2. resume, pause inside the step-4 save, SIGKILL rank 1 there
    out, err = (root / "crash.stdout").open("w+"), (root / "crash.stderr").open("w+")
    # The pause only has to outlast the few milliseconds from the flag to the kill below (a /proc scan and one
    # directory listing); the surviving rank sleeps it out before its gather fails, so every second of it
    # is a second of this fixture. 3 s is still hundreds of times what the kill needs on a loaded machine.
    env = _env(ZOFF_TEST_PAUSE_IN_SAVE=str(PAUSE_S), ZOFF_TEST_PAUSE_FLAG=str(flag))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "inject"), env["PYTHONPATH"]])  # the pause
    launcher = subprocess.Popen(
        _argv(run_dir, "--resume", "auto", "train.max_steps=6", *CKPT),
        cwd=REPO, env=env, stdout=out, stderr=err, text=True,
    )  # fmt: skip
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 180
        while not flag.exists():
            assert launcher.poll() is None, "the launcher exited before the save paused"
            assert time.monotonic() < deadline, "the save never paused"
            time.sleep(0.05)
        ranks = {p: rank_of(p, run_dir) for p in descendants(launcher.pid)}  # (forks of the rank server)
        workers = {r: p for p, r in ranks.items() if r is not None}
        assert sorted(workers) == [0, 1], workers
        s["tmp_while_paused"] = sorted(p.name for p in ckpt_dir.iterdir())
        os.kill(workers[1], signal.SIGKILL)  # a rank, not the launcher
        s["kill_after_s"] = time.time() - flag.stat().st_mtime  # since the first rank's pause began
        s["crash_rc"] = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    s["orphans"] = [p for p in workers.values() if alive(p)]
    out.seek(0), err.seek(0)
    s["crash_stdout"], s["crash_stderr"] = out.read(), err.read()
    out.close(), err.close()
    s["after_crash"] = snapshot(ckpt_dir)
    s["metrics_after_crash"] = (run_dir / "metrics.jsonl").read_text()

    # 3. resume again, no pause: completes
    s["final"] = train(run_dir, "--resume", "auto", "train.max_steps=6", *CKPT)
    s["metrics_after_final"] = (run_dir / "metrics.jsonl").read_text()
    return s


def test_resume_auto_without_checkpoint_starts_fresh(scenario) -> None:
    p = scenario["first"]
    assert f"zoff: no checkpoint in {scenario['ckpt_dir']}: starting fresh" in p.stdout
    assert "resumed from" not in p.stdout
    assert [r["step"] for r in step_records(scenario["metrics_after_first"])] == [1, 2]


def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(scenario) -> None:
    assert ".tmp-step_00000004" in scenario["tmp_while_paused"], "the kill must land inside the step-4 save"
    assert scenario["kill_after_s"] < PAUSE_S, f"killed {scenario['kill_after_s']:.1f} s into the pause"
    assert RESUMED_FROM_2.search(scenario["crash_stdout"]), scenario["crash_stdout"]
    assert scenario["crash_rc"] != 0, scenario["crash_stderr"]
    assert "zoff: training failed" in scenario["crash_stderr"], scenario["crash_stderr"]
    # The step-4 save never completed: the final message names step 2, which this run resumed from.
    step2 = scenario["ckpt_dir"] / "step_00000002"
    assert (
        f"zoff: the last complete checkpoint is step 2 ({step2}, saved before this run); continue from it with:"
        in scenario["crash_stderr"]
    ), scenario["crash_stderr"]
    assert scenario["orphans"] == [], "the surviving rank must be stopped with the launcher"
    snap = scenario["after_crash"]
    assert set(snap["entries"]) - {".tmp-step_00000004"} == {"latest", "step_00000002"}, snap["entries"]
    assert snap["latest"] == "step_00000002"
    assert snap["found"] == scenario["ckpt_dir"] / "step_00000002"
    assert snap["verified_step"] == 2
    # the killed run did train steps 3 and 4 before it died in the save
    assert [r["step"] for r in step_records(scenario["metrics_after_crash"])] == [1, 2, 3, 4]


def test_resume_auto_after_the_crash_completes(scenario) -> None:
    p = ok(scenario["final"])
    assert RESUMED_FROM_2.search(p.stdout), p.stdout
    # the resumed run logs steps 3.. onward, replacing the killed run's records of steps 3-4: each step once
    final = step_records(scenario["metrics_after_final"])
    assert [r["step"] for r in final] == [1, 2, 3, 4, 5, 6]
    assert final[:2] == step_records(scenario["metrics_after_first"])
    # same checkpoint, same data order and RNG: steps 3-4 repeat the killed run's losses bit for bit
    crashed = step_records(scenario["metrics_after_crash"])[2:]
    assert [r["loss"] for r in final[2:4]] == [r["loss"] for r in crashed]


def test_keep_last_leaves_the_two_newest_checkpoints(scenario) -> None:
    ckpt_dir = scenario["ckpt_dir"]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_00000004", "step_00000006"]
    assert (ckpt_dir / "latest").read_text().strip() == "step_00000006"
    for step in (4, 6):
        assert read_manifest(ckpt_dir / f"step_{step:08d}", verify=True)["step"] == step


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def test_resume_from_a_corrupted_checkpoint_fails_before_any_rank_starts(scenario) -> None:
    run_dir = scenario["run_dir"]
    bad = scenario["root"] / "corrupted"
    shutil.copytree(scenario["ckpt_dir"] / "step_00000006", bad)
    shard = bad / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    before = _tree(run_dir)
    p = train(run_dir, "--resume", str(bad), "train.max_steps=8", *CKPT)
    assert p.returncode == 2, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zoff: error: "), p.stderr
    assert str(shard) in lines[0] and "truncated" in lines[0], lines[0]
    assert "zoff plan" not in p.stdout and "run directory" not in p.stdout, p.stdout
    assert _tree(run_dir) == before, "no rank may start: nothing in the run dir (logs, metrics) changes"
