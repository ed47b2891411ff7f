"""A disk that fails mid-run (issue 67, item 5): EIO or ENOSPC on a swap file or on the checkpoint being written,
after start-up, in a real `zoff train` of 2 ranks. The run ends with exit 1 and one zoff line naming the file,
the error, what was being done and the step, then the checkpoint --resume auto would load (and the command that
does); no traceback on the terminal. The checkpoints saved before stay complete, `latest` on the newest of
them, retention deletes none of them for the failed save, and the run resumes from it.

The faults are injected from outside (tests/inject/sitecustomize.py wraps os.pwritev / os.fsync in every
process of the run, the ranks' I/O threads included); one test fills a real loop-mounted ext4 filesystem.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.processes import REPO, checkpoint_steps, events
from zoff.checkpoint.format import find_checkpoint, read_manifest

pytestmark = pytest.mark.slow

INJECT = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "inject"), str(REPO)])}
COMMON = ("launch.threads_per_rank=1", "train.log_every=1", "train.max_steps=12", "checkpoint.every_steps=3")
LINE = re.compile(
    r"zoff: disk error: \[Errno (\d+)\] [^:]+: (\S+) \((.*), step (\d+), rank (\d)\); the last complete "
    r"checkpoint is step (\d+) \((\S+), saved by this run\); continue from it with:\n  (zoff train .*)\n"
)


def _disk_tier(swap: Path) -> tuple[str, ...]:
    return (
        "zero=zero2-nvme",
        f"zero.offload_optimizer.nvme_path={swap}",
        "zero.offload_optimizer.host_budget=min",
        # (without speculation: which file a step reads, the swap file or a second slot's, follows its commits,
        # and the fault counts the swap file's calls; a count that moved let one run in the suite end cleanly)
        "zero.offload_optimizer.speculate=false",
    )


def _fault(kind: str, glob: str, ops: str, after: int, rank: int) -> dict:
    """The environment that fails the calls `ops` on files matching `glob` in rank `rank`, after `after` of them."""
    return INJECT | {
        "ZOFF_TEST_IO_FAULT": kind, "ZOFF_TEST_IO_FAULT_PATH": glob, "ZOFF_TEST_IO_FAULT_OPS": ops,
        "ZOFF_TEST_IO_FAULT_AFTER": str(after), "ZOFF_TEST_IO_FAULT_RANK": str(rank),
    }  # fmt: skip


def _failed_run(agent, ckpt_dir: Path) -> re.Match:
    """Exit 1, the disk line and the resume line as the terminal's only zoff lines, no traceback; the step it
    names is the newest checkpoint on disk, `latest`, whole (every checksum), and every other one is whole."""
    assert agent.wait(timeout=240) == 1, agent.report()
    err = agent.stderr
    m = LINE.search(err)
    assert m, agent.report()
    assert [x for x in err.splitlines() if x.startswith("zoff")] == [m.group(0).splitlines()[0]], (
        agent.report()
    )
    assert "Traceback" not in err, agent.report()
    steps = checkpoint_steps(ckpt_dir)
    assert steps and int(m.group(6)) == steps[-1] < int(m.group(4)), (steps, err)
    assert m.group(7) == str(ckpt_dir / f"step_{steps[-1]:08d}")
    assert (ckpt_dir / "latest").read_text().strip() == f"step_{steps[-1]:08d}"
    assert find_checkpoint("auto", ckpt_dir) == ckpt_dir / f"step_{steps[-1]:08d}"
    for s in steps:
        read_manifest(ckpt_dir / f"step_{s:08d}", verify=True)
    return m


@pytest.mark.parametrize("op", ["pwritev", "preadv"])
def test_a_swap_file_failing_mid_run_ends_in_one_line_and_the_run_resumes(agents, tmp_path, swap, op) -> None:
    """EIO on rank 1's optimizer swap file from its 25th write (or 3rd read) on, a step or two after the
    checkpoint of step 6: the error surfaces from the I/O thread in the step waiting on it; the swap files go
    with the run. The printed command resumes (once, after the write's case)."""
    run, swapped = tmp_path / "run", str(swap / "rank1" / "optimizer.swap")
    fault = _fault("eio", "*/rank1/optimizer.swap", op, 24 if op == "pwritev" else 2, rank=1)
    a = agents(run, *COMMON, "checkpoint.keep_last=2", *_disk_tier(swap), env=fault)
    m = _failed_run(a, run / "checkpoints")
    assert (m.group(1), m.group(2), m.group(5)) == ("5", swapped, "1"), m.group(0)
    assert m.group(3).startswith(f"swap {'write' if op == 'pwritev' else 'read'} at byte "), m.group(0)
    assert len(checkpoint_steps(run / "checkpoints")) == 2  # keep_last's, as before the fault
    assert list(swap.iterdir()) == []  # no swap file left behind on the failed disk
    assert not (run / "disk_error.json").exists()  # read and forgotten: a resume starts without it
    if op == "preadv":
        return
    # the command printed resumes from the checkpoint it names, and trains to the end
    b = agents(run, argv=shlex.split(m.group(8)), name="resume").ok()
    assert [e["step"] for e in events(run, "resume")] == [int(m.group(6))], b.report()
    assert checkpoint_steps(run / "checkpoints")[-1] == 12


@pytest.mark.parametrize(
    ("kind", "glob", "rank", "errno"),
    [
        ("enospc", "*/.tmp-step_*/shard_00001.safetensors", 1, 28),
        ("eio", "*/.tmp-step_*/manifest.json", 0, 5),
    ],
    ids=["enospc-rank1-shard", "eio-rank0-manifest"],
)
def test_a_checkpoint_write_failing_is_never_latest_and_prunes_nothing(
    agents, tmp_path, swap, kind: str, glob: str, rank: int, errno: int
) -> None:
    """The save of step 6 fails (each of these files is written and fsynced once per save; the first save's
    go through): rank 1's shard copy meets ENOSPC, or rank 0's manifest fsync meets EIO. keep_last=1: the
    checkpoint of step 3 is still there, `latest`, whole; the half-written step 6 is no checkpoint at all."""
    run = tmp_path / "run"
    a = agents(
        run,
        *COMMON,
        "checkpoint.keep_last=1",
        *_disk_tier(swap),
        env=_fault(kind, glob, "pwritev,fsync", 1 + (rank == 1), rank),
    )
    m = _failed_run(a, run / "checkpoints")
    ckpt = run / "checkpoints"
    assert checkpoint_steps(ckpt) == [3] and m.group(4) == "6", m.group(0)
    assert (m.group(1), m.group(3), m.group(5)) == (
        str(errno),
        "checkpoint write" + (" at byte 0" if rank else ""),
        str(rank),
    )
    assert m.group(2) == str(ckpt / ".tmp-step_00000006" / glob.rsplit("/", 1)[1]), m.group(0)
    assert not (ckpt / "step_00000006").exists()


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB ext4 filesystem (no journal, no reserved blocks) mounted on a loop device: room for four of the
    tiny model's checkpoints (438 KiB each). Root only; unmounted afterwards whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("a loop mount needs root")
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "2M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", str(image)], check=True)
    p = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot loop-mount here: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_checkpoint_disk_filling_up_ends_in_one_line_naming_the_file(agents, tmp_path, small_disk) -> None:
    """A real ENOSPC: checkpoint.dir on the small filesystem, keep_last large enough that it fills up after a
    few saves. The failed save's file is named, the ones before it stay whole and `latest`."""
    run, ckpt = tmp_path / "run", small_disk / "ckpt"
    a = agents(
        run,
        *COMMON,
        "train.max_steps=20",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=10",
        f"checkpoint.dir={ckpt}",
    )
    m = _failed_run(a, ckpt)
    assert m.group(1) == "28" and m.group(3).startswith("checkpoint write"), m.group(0)
    assert m.group(2).startswith(str(ckpt / f".tmp-step_{int(m.group(4)):08d}") + "/"), m.group(0)
