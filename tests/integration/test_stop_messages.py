"""Stops that end at once when asked twice, and a final message that says what is on disk (issue 25).

A real `zoff train configs/tiny.yaml` on 2 ranks; one rank is frozen with SIGSTOP, so the first SIGTERM's
checkpoint can never be written (the other rank waits for it in a collective, launch.timeout_s and
launch.shutdown_timeout_s at their defaults of 600 s and 300 s). The second signal must kill both ranks and
end `zoff train` with 128 + that signal, saying that no checkpoint was written for the stop and naming the
last complete one, or that there is none. The normal preemption's message (a checkpoint at the step
reached, and a bit-identical continuation) is held by test_fault_tolerance's preemption tests.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.processes import Agent, alive, checkpoint_steps, last_step, wait_for

pytestmark = pytest.mark.slow

COMMON = ("zero=zero2", "launch.threads_per_rank=1", "train.log_every=1", "train.max_steps=100000")
FIRST_SIGNAL_SEEN = "asking the ranks to finish their step and checkpoint"
EXIT_BOUND_S = 15  # the bound, from the first SIGTERM to the launcher's exit


def _stop_with_a_frozen_rank(agents, run_dir: Path, cfg: tuple[str, ...], second: signal.Signals) -> dict:
    """Train until step 8 (and a checkpoint, where the config saves any), SIGSTOP rank 1, then SIGTERM and
    `second` to the launcher. Returns its exit code, seconds from the first signal, stderr, and the ranks."""
    a: Agent = agents(run_dir, *COMMON, *cfg)
    ranks = a.wait_workers(2)
    periodic = any(c.startswith("checkpoint.every_steps=") for c in cfg)
    wait_for(lambda: last_step(run_dir) >= 8, "step 8", a)
    if periodic:
        wait_for(lambda: checkpoint_steps(run_dir / "checkpoints"), "a periodic checkpoint", a)
    frozen = ranks[1]
    try:
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        os.kill(a.pid, signal.SIGTERM)
        # The two signals must reach the launcher as two: the second is sent once the first was handled.
        wait_for(
            lambda: FIRST_SIGNAL_SEEN in a.stderr, "the launcher to take the first SIGTERM", a, timeout=60
        )
        os.kill(a.pid, second)
        code = a.wait(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if alive(frozen):  # let it go, so that whatever comes next (cleanup's SIGKILL) reaches a live process
            os.kill(frozen, signal.SIGCONT)
    # Both ranks are gone (killed, not left behind stopped): a zombie awaiting its reaper counts as gone.
    wait_for(lambda: not any(alive(p) for p in ranks.values()), "the ranks to be gone", timeout=30)
    return {"code": code, "elapsed": elapsed, "stderr": a.stderr, "report": a.report(), "agent": a}


def test_sigstop_then_sigterm_twice_exits_at_once_naming_the_last_checkpoint(agents, tmp_path):
    run_dir = tmp_path / "run"
    r = _stop_with_a_frozen_rank(
        agents, run_dir, ("checkpoint.every_steps=3", "checkpoint.keep_last=2"), signal.SIGTERM
    )
    assert r["code"] == 143, r["report"]
    assert r["elapsed"] < EXIT_BOUND_S, f"{r['elapsed']:.1f}s\n{r['report']}"
    ckpts = checkpoint_steps(run_dir / "checkpoints")
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    m = re.search(
        r"zoff: stopped by signal 15 \(SIGTERM\), the ranks killed by a second one; no checkpoint was written "
        r"for the stop; the last complete checkpoint is step (\d+) \((\S+), saved by this run\); "
        r"continue from it with:\n  (zoff train .*)",
        r["stderr"],
    )
    assert m, r["report"]
    step = int(m.group(1))
    # The step named is the latest complete one on disk, the one --resume auto would load.
    assert step == ckpts[-1] and latest == f"step_{step:08d}", (step, ckpts, latest)
    assert m.group(2) == str(run_dir / "checkpoints" / f"step_{step:08d}")
    assert m.group(3).endswith(f"--run-dir {run_dir} --resume auto"), m.group(3)
    assert "after checkpointing" not in r["stderr"], r["report"]
    assert "Traceback" not in r["stderr"], r["report"]


def test_a_second_signal_of_the_other_kind_kills_too_and_says_there_is_no_checkpoint(agents, tmp_path):
    """No periodic checkpoints: nothing on disk at all. SIGTERM then Ctrl-C (SIGINT): exit 130."""
    run_dir = tmp_path / "run"
    r = _stop_with_a_frozen_rank(agents, run_dir, (), signal.SIGINT)
    assert r["code"] == 130, r["report"]
    assert r["elapsed"] < EXIT_BOUND_S, f"{r['elapsed']:.1f}s\n{r['report']}"
    assert checkpoint_steps(run_dir / "checkpoints") == []
    expected = (
        "zoff: stopped by signal 15 (SIGTERM), the ranks killed by signal 2 (SIGINT); no checkpoint was "
        f"written for the stop; {run_dir / 'checkpoints'} holds no complete checkpoint; start again with:\n"
        "  zoff train "
    )
    assert expected in r["stderr"], r["report"]
    assert "Traceback" not in r["stderr"], r["report"]


def test_a_signal_landing_inside_a_log_call_is_delivered_again_outside_it(monkeypatch):
    """Raised inside a logging call, the launcher's SignalException would be swallowed by logging (a traceback
    printed, and a first signal lost: no checkpoint, the run going on). Such a signal is sent again a moment
    later, and taken outside the log call; a second one still kills the ranks at once."""
    import logging
    import sys

    from torch.distributed.elastic.multiprocessing.api import SignalException

    import zoff.launch.elastic as launch

    sent, killed = [], []
    monkeypatch.setattr(launch, "_redeliver", lambda signum, after_s=0.05: sent.append(signum))
    monkeypatch.setattr(launch, "kill_ranks", lambda: killed.append(True) or 2)
    monkeypatch.setattr(launch, "_exit_later", lambda seconds, code: None)
    stops = launch.StopSignals(300)

    class InsideALogCall(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stops._handle(signal.SIGTERM, sys._getframe())  # the signal lands here, inside logging

    log = logging.getLogger("zoff-test-signal-in-logging")
    log.addHandler(InsideALogCall())
    log.propagate = False
    try:
        log.warning("first")  # first signal: not taken here, sent again
        assert stops.first is None and sent == [signal.SIGTERM]
        with pytest.raises(SignalException):
            stops._handle(signal.SIGTERM, sys._getframe())  # its redelivery, outside any log call
        assert stops.first == signal.SIGTERM and not killed
        log.warning("second")  # second signal inside a log call: the ranks die now, Abort comes after
        assert stops.second == signal.SIGTERM and killed == [True] and sent == [signal.SIGTERM] * 2
        with pytest.raises(launch.Abort):
            stops._handle(signal.SIGTERM, sys._getframe())
        assert killed == [True]  # killed once
    finally:
        log.handlers.clear()


def test_a_signal_after_the_stop_is_dropped_if_sent_again_and_ends_the_launcher_if_new(monkeypatch):
    """CI caught a SIGINT that _redeliver sent 50 ms after a second signal landed in a log call: by then the
    agent had returned, Python's own handler was back, and the exit printed a KeyboardInterrupt traceback from
    the fork server's atexit. After a stop the late redelivery is dropped, and a new signal ends the launcher
    at once with 128 + the signal, never a traceback."""
    import sys

    import zoff.launch.elastic as launch

    exits, said = [], []
    monkeypatch.setattr(launch, "_redeliver", lambda signum, after_s=0.05: None)  # sent by hand below
    monkeypatch.setattr(launch, "kill_ranks", lambda: 2)
    monkeypatch.setattr(launch, "_exit_later", lambda seconds, code: None)
    monkeypatch.setattr(launch, "_say", said.append)
    monkeypatch.setattr(launch.os, "_exit", exits.append)
    before = signal.getsignal(signal.SIGINT)
    stops = launch.StopSignals(300)
    with stops:
        with pytest.raises(launch.SignalException):
            stops._handle(signal.SIGTERM, sys._getframe())
        stops.second = signal.SIGINT  # the second signal came inside a log call: its Abort is sent again
        stops._redeliver(signal.SIGINT)
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the redelivery, landing after the agent returned
        time.sleep(0.05)
        assert exits == [], said
        os.kill(os.getpid(), signal.SIGINT)  # the user's next Ctrl-C
        time.sleep(0.05)
        assert exits == [130] and said[-1] == "zoff: SIGINT again: exiting now", said
    finally:
        signal.signal(signal.SIGINT, before)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
