"""zoff/host/process_exit.py: a process ended without the interpreter's teardown still does what anyone can see
of an exit: its code, atexit handlers, threads joined, loggers' files and stdio flushed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PRELUDE = """
import atexit, logging, sys, threading, time
from zoff.host.process_exit import end_at_exit, exit_now
out = sys.argv[1]
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
def late():
    time.sleep(0.2)
    open(out + ".thread", "w").write("joined")
threading.Thread(target=late).start()
logging.basicConfig(filename=out + ".log", level=logging.INFO)
logging.info("flushed")
print("buffered", end="")
"""


def _run(tmp_path: Path, tail: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    out = tmp_path / "o"
    p = subprocess.run(
        [sys.executable, "-c", PRELUDE + tail, str(out)], capture_output=True, text=True, timeout=60
    )
    seen = {
        k: (tmp_path / f"o.{k}").read_text()
        for k in ("atexit", "thread", "log")
        if (tmp_path / f"o.{k}").exists()
    }
    return p, seen


@pytest.mark.parametrize(
    "tail, code, err",
    [
        ("exit_now(3)", 3, ""),
        ("end_at_exit(); sys.exit()", 0, ""),
        ("end_at_exit(); sys.exit(4)", 4, ""),
        ("end_at_exit(); sys.exit('zoff: error: why')", 1, "zoff: error: why\n"),
    ],
)
def test_the_exit_keeps_code_handlers_threads_files_and_stdio(
    tmp_path: Path, tail: str, code: int, err: str
) -> None:
    p, seen = _run(tmp_path, tail)
    assert (p.returncode, p.stdout, p.stderr) == (code, "buffered", err)
    assert seen == {"atexit": "ran", "thread": "joined", "log": "INFO:root:flushed\n"}


def test_the_zoff_command_ends_with_its_code_and_one_line(tmp_path: Path) -> None:
    """The console entry (zoff.__main__.entry): a missing config is one line and exit 2, as main() says."""
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "train", str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == f"zoff: error: {tmp_path / 'none.yaml'}: config file not found\n"
