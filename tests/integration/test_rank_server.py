"""zoff/launch/rank_server.py: the ranks are forks of a server started when `zoff train` has read its config.
What a rank would have had as a fresh interpreter it still has (the launcher's variables, its share of the
cores as libgomp reads it at load), and a run that stops before its ranks leaves no server behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

# A model factory that records, in every process that builds the model (the launcher's pre-flight, each
# rank), what the process sees, then builds the builtin GPT of the section.
FACTORY = """
import dataclasses, json, os, threading
from zoff.models import build_model

def build(cfg):
    def threads_in_a_new_thread(out):
        import ctypes
        maps = open("/proc/self/maps").read().split()
        gomp = ctypes.CDLL(next(m for m in maps if "libgomp" in m))  # the one torch loaded
        out.append(gomp.omp_get_max_threads())  # a new thread's: from OMP_NUM_THREADS when libgomp loaded

    seen = []
    t = threading.Thread(target=threads_in_a_new_thread, args=(seen,))
    t.start()
    t.join()
    keys = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "ZOFF_BOUND_STORE", "RANK", "MARK")
    record = {"pid": os.getpid(), "ppid": os.getppid(), "env": {k: os.environ.get(k) for k in keys},
              "new_thread_threads": seen[0]}
    with open(os.path.join(os.environ["MARK"], f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)
    return build_model(dataclasses.replace(cfg, name="gpt"))
"""


def _zoff_train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "seeing.py").write_text(FACTORY)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}", "MARK": str(tmp_path)}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        [sys.executable, "-m", "zoff", "train", str(REPO_ROOT / "configs" / "tiny.yaml"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_ranks_are_forks_of_the_server_with_the_launchers_variables_and_threads(tmp_path: Path) -> None:
    p = _zoff_train(
        tmp_path, "model.name=python:seeing:build", "train.max_steps=2", "launch.threads_per_rank=1",
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    seen = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
    launcher = [s for s in seen if s["env"]["RANK"] is None]
    ranks = sorted((s for s in seen if s["env"]["RANK"] is not None), key=lambda s: s["env"]["RANK"])
    assert len(launcher) == 1 and [r["env"]["RANK"] for r in ranks] == ["0", "1"], seen
    server = {r["ppid"] for r in ranks}
    assert len(server) == 1 and server != {launcher[0]["pid"]}, "both ranks are children of one server"
    for r in ranks:
        assert r["env"] == {
            "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "ZOFF_BOUND_STORE": "1",
            "RANK": r["env"]["RANK"], "MARK": str(tmp_path),
        }  # fmt: skip
        assert r["new_thread_threads"] == 1  # as a fresh interpreter started with OMP_NUM_THREADS=1 would


def test_a_run_refused_after_its_config_is_read_leaves_no_server(tmp_path: Path) -> None:
    """The interface check comes after the server's start: the server is stopped with the launcher."""
    p = _zoff_train(tmp_path, "launch.interface=nosuchif0", "--rdzv-endpoint", "127.0.0.1:29999")
    assert p.returncode == 2 and p.stderr.startswith("zoff: error: launch.interface: 'nosuchif0'"), p.stderr
    left = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmd and str(tmp_path).encode() in cmd:  # (its sys.path names tmp_path)
            left.append(entry.name)
    assert left == []


def test_the_servers_imports_never_ask_for_cuda() -> None:
    """CUDA cannot be used in a fork of a process that has initialised it, and asking for the device count
    initialises the driver: the modules the server imports must not ask (on a GPU host a rank would fail)."""
    from zoff.launch.rank_server import RANK_MODULES

    code = (
        "import importlib, sys, torch\n"
        "def asked(*a, **k):\n"
        "    raise SystemExit('torch.cuda was asked at import')\n"
        "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device'):\n"
        "    setattr(torch.cuda, name, asked)\n"
        f"for m in {RANK_MODULES!r}:\n"
        "    importlib.import_module(m)\n"
        "print('imported')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert (p.returncode, p.stdout, p.stderr) == (0, "imported\n", "")


def test_a_python_without_the_servers_private_pid_still_starts(monkeypatch) -> None:
    """The running server's pid is multiprocessing's private attribute: where a Python lacks it, start() runs
    (the server is not killed at exit then, and ends with this process), it does not raise."""
    from types import SimpleNamespace

    from zoff.launch import rank_server

    monkeypatch.setattr(rank_server.forkserver, "_forkserver", SimpleNamespace())
    assert rank_server._server_pid() is None
