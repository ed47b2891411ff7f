"""Exact speculation on a GPU (zero.offload_optimizer.speculate): the gradients come down through the pinned
staging on the landing thread (comm/landing.py) and the speculation's worker reads them from the host tier's
shards or the gradient swap file while backward runs on the GPU's stream; committed parameters go up through
the staging's side stream. Speculation on equals off bit for bit, as tests/integration/test_speculation.py
holds on the CPU, and it commits.

Skipped where torch has no CUDA device. On a GPU machine: `python -m pytest -q -m cuda tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zoff.config import OffloadOptimizerConfig, OffloadParamConfig, OptimConfig, OptimizerIoConfig, ZeroConfig
from zoff.engine import build_engine
from zoff.models.gpt import GPT

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(spec: bool, swap: Path, stage: int, opt: str, par: str, overlap: bool, clip: float) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    zero = ZeroConfig(
        stage=stage, reduce_bucket_size=20000, param_persistence_threshold=64,
        offload_optimizer=OffloadOptimizerConfig(
            device=opt, nvme_path=str(swap) if opt == "nvme" else None, io=OptimizerIoConfig(threads=2, request_mb=1),
            host_budget="min" if opt == "nvme" else "2GiB", overlap_step=overlap, speculate=spec,
        ),
        offload_param=OffloadParamConfig(device=par),
    )  # fmt: skip
    eng = build_engine(
        GPT(4, 2, 128, 256, 32), zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision="bf16",
        grad_clip=clip, grad_accum=2, device=dev,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    losses, committed = [], 0
    for _ in range(4):
        eng.zero_grad()
        for micro in range(2):
            x = torch.randint(0, 256, (2, 32), generator=gen).to(dev)
            loss = eng.model(x).float().logsumexp(-1).mean() / 2
            eng.backward(loss, sync=micro == 1, lr=1e-2)
        eng.step(1e-2)
        losses.append(loss.item())
        committed += eng.speculation.last.get("committed", 0) if eng.speculation is not None else 0
    params = {k: v.cpu() for k, v in eng.gathered_params().items()}
    eng.close()
    return {"losses": losses, "params": params, "committed": committed}


@pytest.mark.parametrize(
    ("stage", "opt", "par", "overlap"),
    [
        (2, "cpu", "none", False),
        (3, "cpu", "cpu", True),
        (3, "nvme", "nvme", True),
        (2, "nvme", "none", False),
    ],
)
@pytest.mark.parametrize("clip", [100.0, 0.05])
def test_speculation_on_a_gpu_is_the_step_bit_for_bit(
    stage: int, opt: str, par: str, overlap: bool, clip: float, tmp_path: Path
) -> None:
    off = _run(False, tmp_path / "off", stage, opt, par, overlap, clip)
    on = _run(True, tmp_path / "on", stage, opt, par, overlap, clip)
    assert on["losses"] == off["losses"]
    for name, p in off["params"].items():
        assert torch.equal(on["params"][name], p), name
    assert (
        (on["committed"] > 0) if clip > 1 else (on["committed"] == 0)
    )  # unclipped: it commits; clipped: never
