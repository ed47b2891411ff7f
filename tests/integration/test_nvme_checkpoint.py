"""The disk tier's swap file is its checkpoint shard: a save copies it file to file, a resume into the same
partitioning copies the shard back, and both are bitwise the same run as one that never stopped. Other world
sizes go through the checkpoint's pieces (tests/integration/test_nvme.py holds those)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_nvme import _engine_run
from zoff.checkpoint import load_checkpoint, save_checkpoint
from zoff.checkpoint.format import read_manifest
from zoff.errors import UserError


def _more_steps(eng, seed: int, steps: int = 2) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        eng.zero_grad()
        for micro in range(2):
            loss = eng.model(torch.randint(0, 64, (2, 16), generator=gen)).float().logsumexp(-1).mean() / 2
            eng.backward(loss, sync=micro == 1)
        eng.step(1e-2)
        losses.append(loss.item())
    return losses


def _sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


CASES = [(2, "none", "bf16"), (3, "nvme", "fp32")]


@pytest.mark.parametrize(("stage", "params", "precision"), CASES)
def test_a_save_copies_the_swap_file_and_a_resume_copies_it_back(
    stage: int, params: str, precision: str, swap: Path
) -> None:
    _, _, a = _engine_run(stage, precision, "nvme", swap / "a", steps=3, params=params)
    states = a.optimizer.states
    read0, written0 = states.file.read_bytes, states.file.written_bytes
    ckpt = save_checkpoint(a, swap / "ckpt", 3, {"step": 3}, "{}")
    shard = ckpt / "shard_00000.safetensors"
    # File to file: the save read the swap file once, wrote nothing back, and the shard is its exact copy.
    assert states.file.read_bytes - read0 == states.layout.nbytes == shard.stat().st_size
    assert states.file.written_bytes == written0
    assert _sha(shard) == _sha(states.file.path)
    # ... and a safetensors file every reader takes, with the unit's states under the checkpoint's names.
    tensors = load_file(shard)
    for u in range(len(a.plan.units)):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[f"u{u}.{kind}"], a.optimizer.read(u, kind)), (u, kind)

    _, _, b = _engine_run(stage, precision, "nvme", swap / "b", steps=0, params=params)
    written0 = b.optimizer.states.file.written_bytes
    load_checkpoint(b, ckpt)
    assert b.optimizer.states.file.written_bytes - written0 == b.optimizer.states.layout.nbytes  # one copy
    assert _sha(b.optimizer.states.file.path) == _sha(shard)
    assert _more_steps(b, 7) == _more_steps(a, 7)  # the continuation is the uninterrupted run's, bit for bit
    want, got = a.gathered_params(), b.gathered_params()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    a.close()
    b.close()


def test_a_cpu_offload_checkpoint_is_copied_straight_into_a_disk_tier_run(swap: Path) -> None:
    """Every tier writes the same shard layout, so a run that moves from host memory to disk resumes by copy."""
    _, _, a = _engine_run(2, "bf16", "cpu", swap, steps=3)
    ckpt = save_checkpoint(a, swap / "ckpt", 3, {"step": 3}, "{}")
    _, _, b = _engine_run(2, "bf16", "nvme", swap / "b", steps=0)
    written0 = b.optimizer.states.file.written_bytes
    load_checkpoint(b, ckpt)
    assert b.optimizer.states.file.written_bytes - written0 == b.optimizer.states.layout.nbytes
    assert _more_steps(b, 9) == _more_steps(a, 9)
    b.close()


def test_a_corrupted_shard_is_refused_when_copied_in(swap: Path) -> None:
    _, _, a = _engine_run(2, "fp32", "nvme", swap / "a", steps=2)
    ckpt = save_checkpoint(a, swap / "ckpt", 2, {"step": 2}, "{}")
    a.close()
    shard = ckpt / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5000] ^= 0x40  # a byte of the last unit's exp_avg_sq: the header still matches
    shard.write_bytes(bytes(data))
    _, _, b = _engine_run(2, "fp32", "nvme", swap / "b", steps=0)
    with pytest.raises(UserError, match="shard_00000.safetensors: checksum mismatch"):
        load_checkpoint(b, ckpt)
    b.close()


def test_a_disk_that_fills_during_a_save_names_the_file_and_keeps_the_last_checkpoint(
    swap: Path, repo_root: Path
) -> None:
    """The swap files' space is reserved at start, so a step never meets a full disk; a checkpoint save can
    (its copy claims no space ahead: a network filesystem would write it twice).
    RLIMIT_FSIZE below the shard's size stands in for it (in a child process): the save fails naming the
    shard file, the previous checkpoint stays complete and `latest`, and the next save with room succeeds."""
    code = f"""
import resource, signal
from pathlib import Path
from tests.integration.test_nvme import _engine_run
from zoff.checkpoint import Checkpointer, save_checkpoint
from zoff.config import CheckpointConfig
from zoff.errors import DiskError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
root = Path({str(swap)!r})
_, _, eng = _engine_run(2, "fp32", "nvme", root / "swap", steps=1)
save_checkpoint(eng, root / "ckpt", 1, {{"step": 1}}, "{{}}")
limit = eng.optimizer.states.layout.nbytes - 4096
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    Checkpointer(eng, CheckpointConfig(dir=str(root / "ckpt")), root, "{{}}", 9).save(2, {{"step": 2}})
except DiskError as e:
    print("ERR", e.step, e.what, e)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
save_checkpoint(eng, root / "ckpt", 3, {{"step": 3}}, "{{}}")
eng.close()
"""
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=repo_root
    )
    err = [line for line in p.stdout.splitlines() if line.startswith("ERR")]
    assert p.returncode == 0 and len(err) == 1, p.stdout + p.stderr
    assert re.match(r"ERR 2 checkpoint write at byte [0-9,]+ \[Errno 27\] File too large: ", err[0]), err
    assert err[0].endswith(".tmp-step_00000002/shard_00000.safetensors"), err
    ckpt = swap / "ckpt"
    read_manifest(ckpt / "step_00000001", verify=True)  # whole, every checksum right
    assert not (ckpt / "step_00000002").exists()
    assert (ckpt / "latest").read_text().strip() == "step_00000003"
    read_manifest(ckpt / "step_00000003", verify=True)


def test_a_checkpoint_folder_without_room_for_one_save_is_refused_before_training(
    swap: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """`zoff train` checks the checkpoint folder as it checks the swap folders: room for one checkpoint (and
    the swap files when they share its disk), else one line and exit 2 before any rank starts; a warning when
    keep_last + 1 do not fit. The size is the real one: the shard files of a save match checkpoint_bytes."""
    import shutil as sh

    from tests.harness import tiny_cfg
    from zoff.config import config_from_dict
    from zoff.models import meta_model
    from zoff.planning import disk_room

    raw = tiny_cfg(
        zero={"stage": 2, "reduce_bucket_size": 1500, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "host_budget": "min"}},
        checkpoint={"dir": str(swap / "ckpt" / "new"), "keep_last": 2},
        model={"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 64, "seq_len": 16},
        launch={"nproc_per_node": 1},  # _engine_run's model and partitioning
    )  # fmt: skip
    cfg = config_from_dict(raw)
    model = meta_model(cfg.model)
    one = disk_room.checkpoint_bytes(cfg, model)
    _, _, eng = _engine_run(2, "fp32", "nvme", swap / "run", steps=1)  # the same model and plan
    saved = save_checkpoint(eng, swap / "saved", 1, {"step": 1}, "{}")
    eng.close()
    files = sum(f.stat().st_size for f in saved.iterdir())
    assert files <= one <= files + (1 << 20)  # the shard exactly, and a MiB for the small files

    swaps = disk_room._swap_needs(cfg, model)[swap][1]  # one rank's swap file, on the same disk
    free = lambda n: lambda p: sh._ntuple_diskusage(n, 0, n)  # noqa: E731
    monkeypatch.setattr(disk_room.shutil, "disk_usage", free(one + swaps - 1))
    with pytest.raises(UserError, match=rf"^checkpoint.dir: {swap} has .* free; one checkpoint of this run needs .*"
                                        r"\(and this node's swap files on the same disk .*\)"):  # fmt: skip
        disk_room.check_checkpoint_room(cfg, model, Path(cfg.checkpoint.dir))
    monkeypatch.setattr(disk_room.shutil, "disk_usage", free(2 * one + swaps))
    disk_room.check_checkpoint_room(cfg, model, Path(cfg.checkpoint.dir))
    assert "warning" in capsys.readouterr().out  # two fit, keep_last 2 needs three while a save runs
    monkeypatch.setattr(disk_room.shutil, "disk_usage", free(3 * one + swaps))
    disk_room.check_checkpoint_room(cfg, model, Path(cfg.checkpoint.dir))
    assert capsys.readouterr().out == ""
    off = config_from_dict({**raw, "checkpoint": {"enabled": False}})
    monkeypatch.setattr(disk_room.shutil, "disk_usage", free(0))
    disk_room.check_checkpoint_room(off, model, tmp_path)  # no saves, nothing to check


def test_train_refuses_a_checkpoint_dir_that_is_a_file(tmp_path: Path) -> None:
    from tests.harness import tiny_cfg

    (tmp_path / "f").write_text("")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny_cfg(checkpoint={"dir": str(tmp_path / "f" / "ckpt")})))
    p = subprocess.run([sys.executable, "-m", "zoff", "train", str(cfg), "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"zoff: error: checkpoint.dir: {tmp_path / 'f'} is not a folder"
    ], p.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
