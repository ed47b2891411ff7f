"""`python -m zoff` calls forked from the tests' fork server (tests.harness, which has imported torch and zoff
once per session), for the CLI tests that make dozens of calls that each reject a bad input (test_cli,
test_convert, test_fuzz_inputs, test_trust_checkpoints): a fresh interpreter costs 1.5-5 s of imports per call,
a forked child a fraction of a second.

Each child becomes `python -m zoff ARGS` (runpy, as -m runs it) in the call's cwd and environment, stdout and
stderr into files, and ends as the interpreter would: its exit code, its stderr and an escaping exception's
traceback are that process's own. What no child can show is output printed while the fork server imported
zoff, or by the modules' teardown at exit (skipped: ~1 s with torch); so each module still starts a fresh
interpreter for at least one call of each kind of outcome.
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.harness import _rank_context


def _become_zoff(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """The child: `python -m zoff ARGS`, then the interpreter's exit without tearing the imports down."""
    gc.freeze()  # the server's imports: out of the collection at the end (and their pages stay shared)
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in [(0, os.devnull, os.O_RDONLY), (1, out, write), (2, err, write)]:
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = ["-m", *args]
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
    # threads joined, atexit handlers, finalizers of what the call made, stdio flushed
    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def forked_cli(calls: list[tuple[list, Path, dict]], timeout: float) -> list[subprocess.CompletedProcess]:
    """Each (args, cwd, env) as `python -m zoff ARGS`, all at once; their results in order. A call still
    running after `timeout` seconds is killed (with the others) and raises TimeoutExpired."""
    ctx = _rank_context()
    with tempfile.TemporaryDirectory(prefix="zoff-cli-") as tmp:
        started = []
        for i, (args, cwd, env) in enumerate(calls):
            argv, out, err = [str(a) for a in args], f"{tmp}/{i}.out", f"{tmp}/{i}.err"
            p = ctx.Process(target=_become_zoff, args=(argv, str(cwd), env, out, err))
            p.start()
            started.append((p, argv, out, err))
        deadline, results = time.monotonic() + timeout, []
        for p, argv, out, err in started:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                for q, *_ in started:
                    q.kill()
                    q.join()
                raise subprocess.TimeoutExpired([sys.executable, "-m", "zoff", *argv], timeout)
            results.append(
                subprocess.CompletedProcess(
                    [sys.executable, "-m", "zoff", *argv],
                    p.exitcode,
                    Path(out).read_text(),
                    Path(err).read_text(),
                )
            )
        return results


def zoff_run(
    args: list,
    *,
    cwd: Path | str | None = None,
    env: dict | None = None,
    timeout: float = 300,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m zoff ARGS` run to its end, as subprocess.run(..., capture_output=True, text=True) would:
    forked from the fork server (no imports to pay: ~2-3 s less a call on a 2-core host), or with fresh=True
    in a new interpreter. Fresh where the call depends on what the interpreter imports: PYTHONPATH in `env`
    (hidden or injected modules), variables a library reads at import (huggingface_hub's cache), or output
    printed at import or teardown; and for one call of each kind of outcome in a module (the docstring)."""
    cwd, env = str(cwd or os.getcwd()), dict(os.environ if env is None else env)
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "zoff", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    return forked_cli([(list(args), cwd, env)], timeout)[0]
