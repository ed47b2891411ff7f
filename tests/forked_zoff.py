"""`python -m zoff` calls forked from a server that has imported zoff (and torch) once.

Used by the CLI tests that make dozens of calls which each reject a bad input (test_cli, test_convert,
test_fuzz_inputs, test_trust_checkpoints): a fresh interpreter costs 1.5-5 s of imports per call, a forked
child about 0.15 s. Each such module still runs at least one fresh interpreter per kind of outcome.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# ----------------------------------------------------------------------------- `python -m zoff`, forked
# A fresh `python -m zoff` spends seconds importing typer, zoff and (convert, train) torch, then rejects a
# bad input in milliseconds. A fork server imports them once per module and forks one child per call, which
# becomes `python -m zoff ARGS` (runpy, as -m runs it) in the call's cwd and environment, stdin /dev/null,
# stdout and stderr into files, and ends as the interpreter would: its exit code, its stderr and an escaping
# exception's traceback are that process's own. What no child can show is output printed while the preloaded
# modules were imported (the server checks that there was none) or by their teardown at exit (skipped: ~1 s
# with torch); the calls marked fresh (at least one of each kind of outcome in each module) still start a new
# interpreter.
_FORK_SERVER = r"""
import atexit, gc, json, os, runpy, sys, threading

reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # anything the imports print goes to the server's log (checked empty), not into a reply
for name in sys.argv[1:]:
    __import__(name)
sys.stdout.flush()
sys.stderr.flush()
gc.freeze()  # the children's collections skip (and so do not copy) what the server imported


def become_zoff(call):
    reply.close()
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in [(0, os.devnull, os.O_RDONLY), (1, call["out"], write), (2, call["err"], write)]:
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(call["cwd"])
    os.environ.clear()
    os.environ.update(call["env"])
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = ["-m", *call["args"]]
    try:
        runpy.run_module("zoff", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # as the interpreter ends on one
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the traceback on stderr
        code = 1
    # The interpreter's exit (threads joined, atexit handlers, finalizers of what the call made, stdio
    # flushed) without tearing down the modules imported before the fork: that takes ~1 s with torch.
    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


print("ready", file=reply, flush=True)
for line in iter(sys.stdin.readline, ""):  # a request: a JSON list of calls, run at once
    pids = []
    for call in json.loads(line):
        pid = os.fork()
        if pid == 0:
            become_zoff(call)
        pids.append(pid)
    print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]), file=reply, flush=True)
"""


class ForkServer:
    """Started (importing in the background) when the module starts; ready when its first call comes."""

    def __init__(self, preload: list[str], env: dict, cwd: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zoff-fork-server-"))
        self.log, self.calls, self.preload = self.dir / "server.log", 0, preload
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _FORK_SERVER, *preload], cwd=cwd, env=env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
            )  # fmt: skip
        self.ready: bool | None = None  # not known yet

    def _wait_ready(self) -> None:
        if self.ready is None:
            ready, printed = self._reply(300), self.log.read_text()
            self.ready, self.printed = ready == "ready\n" and not printed, printed
        assert self.ready, f"importing {self.preload} printed:\n{self.printed[-3000:]}"

    def _reply(self, timeout: float) -> str:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.close(kill=True)  # a hung call fails its test, not the suite
            raise subprocess.TimeoutExpired(self.proc.args, timeout)
        line = self.proc.stdout.readline()
        assert line, f"the zoff fork server stopped:\n{self.log.read_text()[-3000:]}"
        return line

    def run(self, calls: list[tuple[list, Path, dict]], timeout: float) -> list[subprocess.CompletedProcess]:
        """Each (args, cwd, env) as `python -m zoff ARGS`, all at once; their results in order."""
        assert self.proc.poll() is None, "the zoff fork server was stopped (an earlier call hung)"
        self._wait_ready()
        batch = []
        for args, cwd, env in calls:
            self.calls += 1
            out, err = self.dir / f"{self.calls}.out", self.dir / f"{self.calls}.err"
            batch.append(dict(args=[str(a) for a in args], cwd=str(cwd), env=env, out=str(out), err=str(err)))
        self.proc.stdin.write(json.dumps(batch) + "\n")
        self.proc.stdin.flush()
        codes = json.loads(self._reply(timeout))
        return [
            subprocess.CompletedProcess(
                [sys.executable, "-m", "zoff", *c["args"]],
                code,
                _read_once(c["out"]),
                _read_once(c["err"]),
            )
            for c, code in zip(batch, codes)
        ]

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # ends the server's loop
            try:
                self.proc.wait(timeout=0 if kill else 30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the children it forked
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _read_once(path: str) -> str:
    p = Path(path)
    text = p.read_text()
    p.unlink()
    return text


class ModuleServer:
    """A test module's ForkServer: `fixture()` gives the autouse module fixture that starts it (importing while
    the module's first tests run) and closes it after the module's last test; `run` as ForkServer.run."""

    def __init__(self, preload: list[str], env: Callable[[], dict], cwd: Callable[[], Path]) -> None:
        self.preload, self.env, self.cwd = preload, env, cwd
        self.server: ForkServer | None = None

    def fixture(self):
        @pytest.fixture(scope="module", autouse=True)
        def fork_server():
            self.server = ForkServer(self.preload, self.env(), self.cwd())
            yield self.server
            self.server.close()
            self.server = None

        return fork_server

    def run(self, calls: list[tuple[list, Path, dict]], timeout: float) -> list[subprocess.CompletedProcess]:
        assert self.server is not None, "the module's fork server runs only while its tests do"
        return self.server.run(calls, timeout)
