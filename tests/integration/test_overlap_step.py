"""The overlapped step (zero.offload_optimizer.overlap_step, engine/step/overlap.py): the optimizer's walk runs in
a background thread while the next forward gathers, each gather waiting for its unit's update. The same
numbers as the step that runs first, bit for bit (the pattern zoo's 3-nvme-overlap cells hold them equal to
plain PyTorch on 2 and 3 ranks), with an evaluation forward during the walk, at any host budget; the config
refuses it where it does not apply."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from zoff.config import (
    IoConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimConfig,
    OptimizerIoConfig,
    ZeroConfig,
    config_from_dict,
)
from zoff.engine import build_engine
from zoff.errors import ConfigError
from zoff.models.gpt import GPT


def _run(
    overlap: bool, swap: Path, precision: str, budget: str, steps: int = 4, accum: int = 2,
    tiers: tuple[str, str] = ("nvme", "nvme"), slow: bool = False, no_wait: bool = False,
):  # fmt: skip
    torch.manual_seed(0)
    opt, par = tiers
    zero = ZeroConfig(
        stage=3, reduce_bucket_size=1500, param_persistence_threshold=64,
        offload_optimizer=OffloadOptimizerConfig(
            device=opt, nvme_path=str(swap) if opt == "nvme" else None,
            io=OptimizerIoConfig(threads=2, request_mb=1), host_budget=budget, overlap_step=overlap,
        ),
        offload_param=OffloadParamConfig(device=par, io=IoConfig(threads=2, request_mb=1)),
    )  # fmt: skip
    eng = build_engine(
        GPT(4, 2, 32, 64, 16), zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision=precision,
        grad_clip=0.05, grad_accum=accum,
    )  # fmt: skip
    if slow:  # each piece's Adam waits a little: the evaluation forward right after a step meets the walk
        kernel = eng.optimizer.kernel
        eng.optimizer.kernel = lambda *a, **k: (time.sleep(0.01), kernel(*a, **k))[1]
    if no_wait:  # a broken engine whose gathers do not wait for the walk (the test must see it)
        eng.gatherer.wait_ready = None
    gen = torch.Generator().manual_seed(1)
    losses, evals = [], []
    for _ in range(steps):
        eng.zero_grad()
        for micro in range(accum):
            x = torch.randint(0, 64, (2, 16), generator=gen)
            loss = eng.model(x).float().logsumexp(-1).mean() / accum
            eng.backward(loss, sync=micro == accum - 1)
        eng.step(1e-2)
        losses.append(loss.item())
        with torch.no_grad():  # an evaluation forward right after the step: it meets the walk in flight
            evals.append(eng.model(x).float().sum().item())
    walked = eng.last_step_times.get("last_walk_s")
    from_memory = eng.param_disk.read_from_memory_bytes if eng.param_disk is not None else None
    params = eng.gathered_params()
    eng.close()
    return losses, evals, params, (walked, from_memory)


@pytest.mark.parametrize(("precision", "budget"), [("bf16", "min"), ("fp32", "min"), ("bf16", "auto")])
def test_the_overlapped_step_gives_the_same_bits(precision: str, budget: str, swap: Path) -> None:
    want_losses, want_evals, want, (_, plain_from_memory) = _run(False, swap / "plain", precision, budget)
    losses, evals, got, (walked, from_memory) = _run(True, swap / "overlap", precision, budget)
    assert losses == want_losses and evals == want_evals
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    assert walked is not None and walked > 0  # the walk really ran in the background
    # the forward took some shards from the walk's held write-backs, not the disk (param_swap.HELD_UNITS)
    assert from_memory > 0 and plain_from_memory == 0


@pytest.mark.parametrize("tiers", [("cpu", "cpu"), ("cpu", "none"), ("nvme", "none")], ids="-".join)
def test_the_overlapped_step_with_parameters_in_memory_gives_the_same_bits(tiers, swap: Path) -> None:
    """zero3-offload (parameters and states in host memory), stage 3 with only the optimizer offloaded, and
    zero3-nvme-opt: the walk (the CPU Adam, and the disk tier's I/O) beside the next forward, which waits for
    each unit's update before gathering it; the same bits, with an evaluation forward during the walk."""
    want_losses, want_evals, want, _ = _run(False, swap / "plain", "bf16", "min", tiers=tiers, slow=True)
    losses, evals, got, (walked, _) = _run(True, swap / "overlap", "bf16", "min", tiers=tiers, slow=True)
    assert losses == want_losses and evals == want_evals
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert walked is not None and walked > 0
    # the check can fail: gathers that do not wait read parameters the walk has not updated yet
    _, broken_evals, _, _ = _run(True, swap / "broken", "bf16", "min", tiers=tiers, slow=True, no_wait=True)
    assert broken_evals != want_evals


def test_overlap_step_applies_to_stage_3_with_optimizer_offload_only(swap: Path) -> None:
    nvme = {"device": "nvme", "nvme_path": str(swap), "overlap_step": True}
    with pytest.raises(ConfigError, match=r"^zero\.offload_optimizer\.overlap_step: needs zero\.stage 3"):
        config_from_dict({"zero": {"stage": 2, "offload_optimizer": nvme}})
    with pytest.raises(ConfigError, match=r"^zero\.offload_optimizer\.overlap_step: needs zero\.stage 3"):
        config_from_dict(
            {"zero": {"stage": 3, "offload_optimizer": {"device": "none", "overlap_step": True}}}
        )
    with pytest.raises(ConfigError, match=r"^zero\.offload_optimizer\.overlap_step: not with delay_update"):
        config_from_dict(
            {
                "zero": {
                    "stage": 3,
                    "offload_optimizer": {**nvme, "delay_update": True, "grad_device": "cpu"},
                    "offload_param": {"device": "nvme"},
                }
            }  # fmt: skip
        )
