"""CUDA-only paths found by reading (issue 15's list), each next to the CPU test that runs the same logic.

Skipped where torch has no CUDA device. On a GPU machine: `python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.harness import free_port
from zoff.config import OptimConfig
from zoff.engine.collectives import Comm
from zoff.engine.optimizer import ShardAdam
from zoff.models.gpt import GPT

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_sum_scalars_reduces_on_the_device_under_nccl() -> None:
    """NCCL rejects host tensors: the step's norm/flag all-reduce must build its tensor on the GPU (the CPU
    suite covers the arithmetic over gloo)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        comm = Comm()
        assert comm.device.type == "cuda"
        assert comm.sum_scalars([1.5, 2.0]) == [1.5, 2.0]
    finally:
        dist.destroy_process_group()


def test_shard_adam_steps_cuda_shards_with_the_fused_kernel() -> None:
    """torch's fused CUDA AdamW reads its step counts on the device (a host step tensor faulted)."""
    master = torch.randn(1000, device="cuda")
    want = master.clone()
    grad = torch.randn(1000, device="cuda")
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = ShardAdam([master], [[(0, 1000, True)]], cfg)
    opt.step([grad], 1e-2)
    ref = torch.nn.Parameter(want)
    ref.grad = grad
    torch.optim.AdamW(
        [ref], lr=1e-2, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=0.1, fused=True
    ).step()
    torch.testing.assert_close(master, ref.detach())


def test_gpt_init_on_a_cuda_view_equals_the_cpu_init() -> None:
    """init_parameter fills a CUDA tensor from its host generator: the same values as on the CPU."""
    torch.manual_seed(0)
    model = GPT(2, 2, 32, 64, 16)
    name = "blocks.0.mlp.fc.weight"
    out = torch.empty(model.get_parameter(name).shape, device="cuda")
    model.init_parameter(name, out)
    assert torch.equal(out.cpu(), model.get_parameter(name).detach())
