"""CUDA-only paths found by reading (issue 15's list), each next to the CPU test that runs the same logic.

Skipped where torch has no CUDA device. On a GPU machine: `python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.harness import free_port
from zoff.checkpoint.format import rng_states, set_rng_states
from zoff.config import OffloadOptimizerConfig, OffloadParamConfig, OptimConfig, ZeroConfig
from zoff.engine import build_engine
from zoff.engine.comm.collectives import CollectiveError, Comm
from zoff.engine.footprint import pinned_host_bytes
from zoff.engine.policy import Policy
from zoff.engine.staging import Staging
from zoff.engine.step.optimizer import ShardOptimizer, torch_fused_kernel
from zoff.engine.step.tiers import DeviceTier
from zoff.models.gpt import GPT
from zoff.planning.memory import pending_gradients
from zoff.trainer.metrics import GPU_PEAK_TFLOPS, MetricsWriter, peak_flops

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
    opt = ShardOptimizer([master], [[(0, 1000, True)]], cfg, DeviceTier(), torch_fused_kernel)
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


def test_cuda_rng_state_round_trips_through_rng_states() -> None:
    """Checkpoints hold the CUDA generator too: dropout on a GPU draws from it, and a resume must continue it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(5)
    states = rng_states(dev)
    assert set(states) == {"cpu", "cuda"}
    want = torch.rand(8, device=dev)
    torch.rand(100, device=dev)  # the stream moves on
    set_rng_states(states, dev)
    assert torch.equal(torch.rand(8, device=dev), want)


def test_staging_moves_device_shards_through_pinned_chunks() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    st = Staging(8192, dev)
    assert st.pinned_bytes == st.nbytes == 8192 and all(b.is_pinned() for b in st.buffers)
    src = torch.randn(50_001, device=dev, dtype=torch.bfloat16)
    host = torch.empty(50_001)
    st.download(src, host)
    assert torch.equal(host, src.float().cpu())
    shard = torch.empty(50_001, device=dev, dtype=torch.bfloat16)
    master = torch.randn(50_001)
    st.upload(master, shard)  # asynchronous on the side stream
    st.uploads_done()  # the compute stream waits for it
    assert torch.equal(shard.cpu(), master.to(torch.bfloat16))


def _engine_losses(
    zero: ZeroConfig, precision: str = "fp32", device: str = "cuda", steps: int = 4
) -> tuple[list[float], object]:
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    model = GPT(2, 2, 32, 64, 16)
    eng = build_engine(model, zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision=precision, device=dev)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        eng.zero_grad()
        x = torch.randint(0, 64, (2, 16), generator=gen).to(dev)
        loss = eng.model(x).float().logsumexp(-1).mean()
        eng.backward(loss)
        eng.step(1e-2)
        losses.append(loss.item())
    eng.flush()
    return losses, eng


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_on_cuda_equals_the_device_optimizer(stage: int) -> None:
    """Optimizer (and at stage 3 parameter) offload on a GPU: gradients down and parameters up through the
    pinned staging buffers, the CPU Adam on pageable states, the gathers reading host shards; the same
    numbers as torch's fused AdamW on the device, and exactly the pinned bytes the estimate predicts.

    After one step the gradients are the same bits and the masters differ only by the two Adam kernels'
    rounding (zoff's CPU Adam and torch's CPU AdamW agree bit for bit; both differ from torch's CUDA kernel by
    <= 3e-8 here). Later steps' gradients then differ by rounding too, and Adam turns a gradient that is only
    rounding noise (~1e-12: the attention key bias's, whose true value is 0) into a step of lr * g / eps: on an
    H200 (gpu_check, 2026-11-26) 49 of 28,032 masters ended 2e-5 = 2e-3 lr apart after 4 steps. A skipped,
    doubled or stale update moves a parameter by about lr, so 4 steps are held to 1e-2 lr.
    """
    off = ZeroConfig(
        stage=stage,
        offload_optimizer=OffloadOptimizerConfig(device="cpu", staging_mb=1),
        offload_param=OffloadParamConfig(device="cpu" if stage == 3 else "none"),
    )
    for steps, atol in ((1, 1e-6), (4, 1e-4)):
        want, ref = _engine_losses(ZeroConfig(stage=stage), steps=steps)
        got, eng = _engine_losses(off, steps=steps)
        assert eng.staging is not None and eng.staging.chunks > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(eng.masters, ref.masters, strict=True):
            torch.testing.assert_close(a.cuda(), b, rtol=1e-5, atol=atol)
    policy = Policy(stage, "cpu", off.offload_param.device)
    assert eng.pinned_bytes() == pinned_host_bytes(eng.plan, policy, off, "fp32", "cuda")
    assert not any(t.is_pinned() for t in eng.optimizer.exp_avg + eng.optimizer.exp_avg_sq)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_gradient_landings_on_their_thread_equal_inline_ones_on_cuda(tier: str, tmp_path) -> None:
    """Issue 32: with overlapped reductions the gradients come down on the landing thread (landing.py, the
    side stream ordered after an event the compute stream recorded), while backward goes on; the same bits
    as landing them inline (overlap_comm off), in host memory and on the disk tier."""

    def run(overlap: bool, where: str) -> tuple[list[float], object]:
        oo = OffloadOptimizerConfig(
            device=tier, staging_mb=1, nvme_path=str(tmp_path / where) if tier == "nvme" else None,
            host_budget="min",
        )  # fmt: skip
        return _engine_losses(
            ZeroConfig(stage=3, overlap_comm=overlap, offload_optimizer=oo), precision="bf16"
        )

    want, inline = run(False, "a")
    got, eng = run(True, "b")
    assert inline.reducer.landings is None and eng.reducer.landings.landed > 0
    assert got == want
    for a, b in zip(eng.gathered_params().values(), inline.gathered_params().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_the_overlapped_step_with_states_in_host_memory_changes_no_bit_on_cuda(params: str) -> None:
    """overlap_step at stage 3 with the CPU Adam: the walk thread uploads each unit's new shard on the staging's
    side stream (params on the GPU) or writes the pinned host shard after the gathers' uploads landed (params
    in host memory), and the forward's gather of a unit waits for it; the same bits as the step run first,
    with an evaluation forward right after each step meeting a walk slowed down on purpose. A broken engine
    whose gathers do not wait must give other evaluations (the check can fail); so must one whose gathers wait
    for the walk on the host but not for their unit's upload on the GPU (issue 54's per-unit wait: the
    Staging.mark event), with each upload held back on the side stream."""
    import time

    dev = torch.device("cuda", torch.cuda.current_device())

    def hold_back_uploads(staging) -> None:
        """Each upload starts ~0.1 s late on the side stream (the host goes on), and no reader waits for it."""
        upload = staging.upload

        def late(src: torch.Tensor, dst: torch.Tensor) -> None:
            with torch.cuda.stream(staging.stream):
                torch.cuda._sleep(200_000_000)
            upload(src, dst)

        staging.upload, staging.wait_for = late, lambda mark: None

    def run(overlap: bool, no_wait: bool = False, no_event: bool = False) -> tuple[list[float], object]:
        zero = ZeroConfig(
            stage=3, param_persistence_threshold=64,
            offload_optimizer=OffloadOptimizerConfig(device="cpu", staging_mb=1, overlap_step=overlap),
            offload_param=OffloadParamConfig(device=params),
        )  # fmt: skip
        torch.manual_seed(0)
        eng = build_engine(
            GPT(2, 2, 32, 64, 16), zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision="bf16", device=dev
        )
        kernel = eng.optimizer.kernel
        eng.optimizer.kernel = lambda *a, **k: (time.sleep(0.01), kernel(*a, **k))[1]
        if no_wait:
            eng.gatherer.wait_ready = None
        if no_event:
            hold_back_uploads(eng.staging)
        gen = torch.Generator().manual_seed(1)
        out = []
        for _ in range(4):
            eng.zero_grad()
            x = torch.randint(0, 64, (2, 16), generator=gen).to(dev)
            eng.backward(eng.model(x).float().logsumexp(-1).mean())
            eng.step(1e-2)
            with torch.no_grad():  # right after the step: the walk is still in flight
                out.append(eng.model(x).float().sum().item())
        eng.flush()
        return out, eng

    want, plain = run(False)
    got, eng = run(True)
    assert eng.overlap is not None and eng.last_step_times.get("last_walk_s", 0) > 0
    assert got == want
    for a, b in zip(eng.gathered_params().values(), plain.gathered_params().values(), strict=True):
        assert torch.equal(a, b)
    broken, _ = run(True, no_wait=True)
    assert broken != want
    if params == "none":  # (the walk uploads each unit's new shard through the staging)
        late, _ = run(True, no_event=True)
        assert late != want


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_keeps_no_gradient_shard_on_the_device(stage: int, tmp_path) -> None:
    """Under offload the device holds no gradient partition: what the engine allocated on the GPU for its
    model states is memory_report()'s params (the policy table's, as `zoff estimate` prints them), and the
    reduction buffers in flight stay within the estimate's bound (no Psi/N term). Printed for gpu_check.sh."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    zero = ZeroConfig(
        stage=stage,
        offload_optimizer=OffloadOptimizerConfig(
            device="nvme" if stage == 2 else "cpu", nvme_path=str(tmp_path), host_budget="min"
        ),
        offload_param=OffloadParamConfig(device="cpu" if stage == 3 else "none"),
        param_persistence_threshold=64,
    )
    torch.manual_seed(0)
    eng = build_engine(
        GPT(4, 2, 256, 512, 64), zero, OptimConfig(), precision="bf16", grad_accum=4, device=dev
    )
    torch.cuda.synchronize()
    built = torch.cuda.memory_allocated(dev) - base
    mem, planned = eng.memory_report(), eng.planned_memory()
    assert mem["grads"] == planned["grads"] == 0
    states = planned["params"] + planned["optimizer_states"]
    buffers = sum(b.numel() * b.element_size() for b in eng.model.buffers())  # the model's own (a mask)
    assert states <= built <= states + buffers + (1 << 20), (built, planned)  # + the allocator's rounding
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        eng.zero_grad()
        for mb in range(4):
            x = torch.randint(0, 512, (2, 64), generator=gen).to(dev)
            eng.backward(eng.model(x).float().logsumexp(-1).mean(), sync=mb == 3)
        eng.step(1e-3)
    bound = pending_gradients(eng.plan, eng.policy, "bf16", True, zero.overlap_comm, "cuda")
    print(f"gpu_check: stage {stage} offload: model states on the GPU {built:,} B (planned "
          f"{planned['params'] + planned['optimizer_states']:,}); gradient buffers peak "
          f"{eng.reducer.peak_bucket_bytes:,} B (bound {bound:,}); host gradient shard {mem['cpu_grads']:,} B")  # fmt: skip
    assert eng.reducer.peak_bucket_bytes <= bound
    assert torch.cuda.memory_allocated(dev) - base <= built + bound + (64 << 20)  # + the allocator's slack
    eng.close()


def test_delayed_update_with_parameter_offload_runs_on_cuda() -> None:
    """DPU + parameter offload: the publish waits for the gathers' uploads of the host shards it overwrites.

    The delayed update's losses on the GPU are the same run's on the CPU (bf16 matmuls round differently on
    the two, hence the tolerance); a publish that raced an upload would train on a half-written shard."""
    zero = ZeroConfig(
        stage=3,
        offload_optimizer=OffloadOptimizerConfig(device="cpu", delay_update=True, staging_mb=1),
        offload_param=OffloadParamConfig(device="cpu"),
    )
    got, _ = _engine_losses(zero, "bf16")
    want, _ = _engine_losses(zero, "bf16", device="cpu")
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    undelayed = OffloadOptimizerConfig(device="cpu", staging_mb=1)
    no_delay, _ = _engine_losses(
        ZeroConfig(stage=3, offload_optimizer=undelayed, offload_param=zero.offload_param), "bf16"
    )
    assert abs(got[1] - no_delay[1]) > 1e-3  # the delay is on: step 2 ran on the parameters before step 1


def _nccl_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    comm = Comm(timeout_s=5.0)
    result = {"separate_gather_group": comm.gather_group is not comm.group}
    assert comm.sum_scalars([float(rank)]) == [1.0]
    if rank == 0:
        try:
            comm.sum_scalars([1.0])  # rank 1 never joins this one
            result["error"] = None
        except CollectiveError as e:
            result["error"] = str(e)
    else:
        time.sleep(25)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    os._exit(0)  # the group is out of step: no teardown


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_timeout_names_the_missing_rank_and_gathers_have_their_own_group(tmp_path) -> None:
    mp.start_processes(_nccl_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0 = torch.load(tmp_path / "rank0.pt")
    assert r0["separate_gather_group"]
    assert r0["error"] is not None and "rank(s) not answering: 1" in r0["error"], r0["error"]


def test_metrics_read_the_gpus_memory_and_peak(tmp_path) -> None:
    """The run's metrics report the device's allocator peak, and MFU where the GPU's peak is in the table."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1 << 20, device=dev)
    w = MetricsWriter(
        tmp_path, 1, 0, False, logging.getLogger("t"), tensorboard=False, flops_per_token=1e9, device=dev
    )
    out = w._resources({"tokens_per_s": 1000.0})
    assert out["peak_alloc_mib"] >= 4.0
    known = any(key in torch.cuda.get_device_name(dev) for key, _, _ in GPU_PEAK_TFLOPS)
    assert (peak_flops(dev, "bf16") is not None) == known and ("mfu" in out) == known


def test_zoff_train_runs_a_rank_on_the_gpu(tmp_path) -> None:
    """The launcher's CUDA branch (device per local rank, NCCL) and the whole trainer on a GPU, end to end."""
    import subprocess
    import sys

    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "zoff", "train", "tiny", "zero=zero3", "launch.nproc_per_node=1",
         "train.max_steps=5", "log.progress=false", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "world size 1 (nccl)" in p.stdout
    assert (run / "summary.json").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("stage", [2, 3])
def test_stages_over_nccl_equal_the_reference_on_two_gpus(stage: int, monkeypatch) -> None:
    """NCCL's own reduce-scatter (flat buckets) and all-gather, and stage 3's second communicator, against
    plain PyTorch on GPU 0."""
    import tests.harness as harness
    from zoff.config import config_from_dict

    monkeypatch.setenv("ZOFF_TEST_DEVICE", "cuda")  # the spawned ranks read it when they import the harness
    monkeypatch.setattr(harness, "TEST_DEVICE", "cuda")
    cfg = harness.tiny_cfg(
        zero={"stage": stage, "param_persistence_threshold": 64, "reduce_bucket_size": 3000}
    )
    got = harness.run_zoff(cfg, 2)[0]
    ref = harness.reference_run(config_from_dict(cfg), 2)
    harness.assert_close_losses(got["losses"], ref["losses"])
    harness.assert_close_params(got["params"], ref["params"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("factory", ["rank_dependent", "skips_last"])
def test_a_block_skipped_on_one_gpu_is_named_within_seconds(factory: str, monkeypatch) -> None:
    """Stage 3 over NCCL, a block one rank runs and the other does not: the same-gathers check runs over its
    gloo group, before any NCCL gather is issued, so both ranks name the block at once (the CPU tests,
    tests/integration/test_stage3_errors.py, run the same path with side_checks forced on gloo)."""
    import tests.harness as harness
    from tests.integration import test_stage3_errors as stage3

    monkeypatch.setenv("ZOFF_TEST_DEVICE", "cuda")  # the ranks read it in harness._entry
    t0 = time.monotonic()
    got = harness.spawn(stage3._train, 2, stage3._cfg(factory, 3))  # launch.timeout_s at its default, 600 s
    assert time.monotonic() - t0 < 120, "a rank waited for a collective timeout"
    for message in got:
        assert message.startswith("SkippedBlockError: zero.stage 3:"), message
        assert "zero.block_classes:" in message, message


def _offload_run(base, x, y, off: bool, dev) -> tuple[float, torch.Tensor, int]:
    """(loss, gradients, device bytes the forward left allocated): in a function of its own, so that nothing
    of another run (a model, a loss whose graph still holds its parameters) is freed during this one."""
    import copy

    from zoff.models import enable_activation_checkpointing, lm_loss
    from zoff.trainer.activation_offload import ActivationOffload

    model = copy.deepcopy(base)
    offload = ActivationOffload(dev) if off else None
    enable_activation_checkpointing(model, offload.checkpoint if offload else None)
    torch.manual_seed(1)  # (dropout: both runs draw the same masks, and each recompute must draw them again)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    loss = lm_loss(model(x), y)
    torch.cuda.synchronize()
    torch.empty(1, device=dev)  # (the allocator frees blocks whose side-stream uses ended at its next malloc)
    after_forward = torch.cuda.memory_allocated(dev) - before
    loss.backward()
    torch.cuda.synchronize()
    return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()]), after_forward


def test_activation_offload_on_cuda_frees_the_inputs_and_changes_nothing() -> None:
    """train.activation_offload's CUDA path (pinned buffers, side stream, prefetch one block ahead): the same
    losses and gradients as checkpointing alone, bit for bit, and after the forward the device holds the
    blocks' inputs fewer bytes (the estimate's host term). With dropout: the recompute replays the GPU's RNG
    state although the block's inputs reach torch's checkpoint as host handles (its anchor tensor)."""
    from zoff.config import ModelConfig
    from zoff.planning.activations import gpt_activations

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = GPT(6, 4, 256, 512, 256, dropout=0.1).to(dev, torch.bfloat16)
    x, y = torch.randint(512, (2, 4, 256), device=dev)
    _offload_run(
        base, x, y, False, dev
    )  # warm-up: cuBLAS's workspace (~32 MiB) is allocated at the first matmul
    plain, offloaded = (_offload_run(base, x, y, off, dev) for off in (False, True))
    m = ModelConfig(name="gpt", n_layer=6, n_head=4, d_model=256, vocab_size=512, seq_len=256)
    inputs = gpt_activations(m, 4, 256, "bf16", True, "cuda", offload=True).host
    assert offloaded[0] == plain[0] and torch.equal(offloaded[1], plain[1])
    moved = plain[2] - offloaded[2]
    assert abs(moved - inputs) <= 1 << 20, (plain[2], offloaded[2], inputs)  # allocator rounding
