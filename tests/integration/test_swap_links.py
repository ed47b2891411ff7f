"""The disk tier on a shared scratch disk (issue 33, item 3): a link planted where a swap file or a rank's
folder goes never sends the swap elsewhere. A planted symlink or hard link at a swap file's name loses its
name and the target keeps its bytes; a rank folder that is a link is refused, by the engine and by `zoff
train` before any rank starts (one line, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked_zoff import zoff_run
from tests.harness import tiny_cfg
from tests.integration.test_nvme import _engine_run
from zoff.errors import UserError

VICTIM = b"someone else's data\n" * 1000


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_planted_at_a_swap_file_leaves_its_target_alone(kind: str, swap: Path) -> None:
    victim = swap / "victim.bin"
    victim.write_bytes(VICTIM)
    folder = swap / "run" / "rank0"
    folder.mkdir(parents=True)
    for name in ("optimizer.swap", "grads.swap"):
        (folder / name).symlink_to(victim) if kind == "symlink" else os.link(victim, folder / name)
    want, _, _ = _engine_run(2, "fp32", "cpu", swap / "ref", steps=2)
    losses, _, eng = _engine_run(2, "fp32", "nvme", swap / "run", steps=2)
    assert losses == want
    assert not eng.optimizer.states.file.path.is_symlink()
    eng.close()
    assert victim.read_bytes() == VICTIM and victim.stat().st_nlink == 1  # the links' names are gone


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_links_planted_at_the_delayed_updates_files_leave_their_target_alone(kind: str, swap: Path) -> None:
    """delay_update on the disk tier opens two more files (the second gradient file, the new parameter shards'
    file): the same rule, a planted link loses its name and its target keeps its bytes."""
    victim = swap / "victim.bin"
    victim.write_bytes(VICTIM)
    folder = swap / "run" / "rank0"
    folder.mkdir(parents=True)
    for name in ("grads.swap", "grads.1.swap", "params.next.swap"):
        (folder / name).symlink_to(victim) if kind == "symlink" else os.link(victim, folder / name)
    want, _, _ = _engine_run(2, "fp32", "cpu", swap / "ref", steps=2, delay=True)
    losses, _, eng = _engine_run(2, "fp32", "nvme", swap / "run", steps=2, delay=True)
    assert losses == want
    assert not any(f.path.is_symlink() for f in (*eng.grads.files, eng.next_params.file))
    eng.close()
    assert victim.read_bytes() == VICTIM and victim.stat().st_nlink == 1


def test_a_rank_folder_that_is_a_link_is_refused(swap: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (swap / "rank0").symlink_to(elsewhere)
    with pytest.raises(UserError, match=r"rank0 is a link or not a folder"):
        _engine_run(2, "fp32", "nvme", swap, steps=1)
    assert list(elsewhere.iterdir()) == []
    cfg = tmp_path / "c.yaml"
    zero = tiny_cfg(zero={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}})[
        "zero"
    ]
    cfg.write_text(f"zero: {zero}\nmodel: {{n_layer: 2, n_head: 2, d_model: 32, seq_len: 16}}\n"
                   "data: {name: synthetic, seq_len: 16, batch_size: 2}\nlaunch: {nproc_per_node: 1}\n")  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "train", str(cfg), f"--run-dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"zoff: error: zero.offload_optimizer.nvme_path: {swap / 'rank0'} is a link or not a folder; the disk "
        "tier swaps only into a real folder"
    ]
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "run").exists()


def test_a_swap_folder_others_can_write_is_refused_unless_allowed(tmp_path: Path) -> None:
    """Others who can write the swap folder (not sticky, unlike /tmp) could replace the rank folders."""
    swap = tmp_path / "shared"
    swap.mkdir()
    os.chmod(swap, 0o777)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"zero: {{stage: 2, offload_optimizer: {{device: nvme, nvme_path: {swap}}}}}\n"
        "model: {n_layer: 2, n_head: 2, d_model: 32, seq_len: 16}\n"
        "data: {name: synthetic, seq_len: 16, batch_size: 2}\nlaunch: {nproc_per_node: 1}\ntrain: {max_steps: 1}\n"
    )
    cmd = ["train", str(cfg), "log.progress=false"]  # (forked: tests.forked_zoff)
    p = zoff_run([*cmd, f"--run-dir={tmp_path / 'run'}"])
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"zoff: error: zero.offload_optimizer.nvme_path: {swap} is writable by other users (mode 777, not "
        "sticky): others could swap the rank folders for theirs; use a folder of your own, or set "
        "zero.offload_optimizer.allow_shared_path: true"
    ]
    assert list(swap.iterdir()) == [] and not (tmp_path / "run").exists()
    os.chmod(swap, 0o1777)  # sticky, as /tmp: accepted
    p = zoff_run([*cmd, f"--run-dir={tmp_path / 'run2'}"])
    assert p.returncode == 0, p.stderr[-2000:]
    os.chmod(swap, 0o777)
    p = zoff_run([*cmd, "zero.offload_optimizer.allow_shared_path=true", f"--run-dir={tmp_path / 'run3'}"])
    assert p.returncode == 0, p.stderr[-2000:]
