"""Offload that offloads the gradients: under every optimizer offload the reduced gradient shard lives in the
optimizer's tier (host memory, or the disk tier's gradient swap file), and the device keeps only what is in
flight.

Each rank runs the engine as on a GPU, where the device is not the host: every reduction finishes in a pooled
device buffer and lands in the tier through the bounded staging (staging.py runs its chunking with null
events on the host). Over gloo at world sizes 1-3 (3 in `-m grid`), stages 1-3, CPU offload and the disk tier
(gradients on disk or in memory), and at stage 3 parameter offload to CPU and to disk; grad_accum 1 in fp32
and 3 in bf16:
- no gradient shard is allocated on the device (memory_report()["grads"] == 0), and the gradient buffers the
  reducer held at its peak are within the estimate's in-flight bound (memory.pending_gradients, which has no
  Psi/N term under offload);
- memory_report() equals the policy table (planned_memory(): footprint.model_states, what `zoff estimate` uses);
- the losses and the final parameters are bit for bit those of the same policy with the reductions landing
  in place (a host-only run), and every tier equals CPU offload bit for bit;
- and the device-bytes check is shown able to fail: an engine made to keep gradients on the device is caught.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import spawn
from zoff.config import OffloadOptimizerConfig, OffloadParamConfig, OptimConfig, ZeroConfig
from zoff.engine.policy import Policy
from zoff.planning.memory import pending_gradients

pytestmark = pytest.mark.slow

# Two steps: what a tier keeps from step to step (optimizer states, offloaded parameters) is written in the
# first and read back in the second, whose gradient window lands over the first one's and whose forwards use
# stage 3's prefetch (the gather order is recorded in step 1); its losses and the final parameters show any
# bit changed on the way. A third step would repeat the second.
STEPS = 2
# (offload_optimizer, grad_device, offload_param): every offload policy, parameter offload (stage 3) included
TIERS = [("cpu", "auto", "none"), ("nvme", "auto", "none"), ("nvme", "cpu", "none")]
PARAM_TIERS = [("cpu", "auto", "cpu"), ("nvme", "auto", "nvme")]
# accumulation and precision in two pairs, not their four products: each is exercised with and without the
# other, and the default suite's time budget holds. Three micro-batches land every way a window has (the first
# copied into the shard, a middle one added, the last added and averaged over the ranks); a fourth would only
# repeat the middle one, at a third more of the accumulating cells' time.
MODES = [(1, "fp32"), (3, "bf16")]
CASES = [
    (stage, tier, accum, precision)
    for stage in (1, 2, 3)
    for tier in TIERS + (PARAM_TIERS if stage == 3 else [])
    for accum, precision in MODES
]
KEYS = (
    "grads",
    "optimizer_states",
    "cpu_params",
    "cpu_grads",
    "cpu_optimizer_states",
    "disk_params",
    "disk_optimizer_states",
    "disk_grads",
)


def _run(
    rank: int, world: int, swap: str, staged: bool, stage: int, tier, accum: int, precision: str,
    leak: bool = False,
) -> dict:  # fmt: skip
    import zoff.engine.policy as policy_mod
    import zoff.engine.zero as zero_mod
    from zoff.engine import build_engine
    from zoff.models.gpt import GPT

    zero_mod.needs_staging = lambda device: staged  # as on a GPU: the device is not the host
    if leak:  # a broken engine that keeps whole gradients on the device under offload (the check must see it)
        policy_mod.Policy.keeps_full_grads = property(lambda self: True)
    opt, grad_device, par = tier
    zero = ZeroConfig(
        stage=stage,
        offload_optimizer=OffloadOptimizerConfig(
            device=opt,
            nvme_path=f"{swap}/{opt}-{grad_device}-{par}-{stage}-{accum}-{precision}-{staged}-{leak}",
            grad_device=grad_device,
            staging_mb=1,
            host_budget="min",  # everything the disk tier can put on disk: the tier under test
        ),  # fmt: skip
        offload_param=OffloadParamConfig(device=par),
        param_persistence_threshold=64,
        reduce_bucket_size=3000,
    )
    torch.manual_seed(0)
    model = GPT(3, 2, 32, 64, 16, tie_embeddings=False)
    eng = build_engine(
        model,
        zero,
        OptimConfig(lr=1e-2, weight_decay=0.1),
        precision=precision,
        grad_clip=0.5,
        grad_accum=accum,
    )
    gen = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    for _ in range(STEPS):
        eng.zero_grad()
        for mb in range(accum):
            x = torch.randint(0, 64, (2, 16), generator=gen)
            loss = eng.model(x).float().logsumexp(-1).mean() / accum
            eng.backward(loss, sync=mb == accum - 1)
            losses.append(loss.item())
        norms.append(eng.step(1e-2).grad_norm)
    mem, planned = eng.memory_report(), eng.planned_memory()
    pending = pending_gradients(eng.plan, eng.policy, precision, accum > 1, zero.overlap_comm, "cuda")
    params = {k: v.clone() for k, v in eng.gathered_params().items()}
    out = {
        "losses": losses, "norms": norms, "params": params, "memory": mem, "planned": planned,
        "peak_grad_buffers": eng.reducer.peak_bucket_bytes, "pending_bound": pending,
        "staging_chunks": eng.staging.chunks if eng.staging is not None else 0,
    }  # fmt: skip
    eng.close()
    return out


def _grid(rank: int, world: int, swap: str) -> dict:
    return {
        (case, staged): _run(rank, world, swap, staged, *case) for case in CASES for staged in (True, False)
    }


# World 3 is in the grid run (python -m pytest -m grid), keeping the default suite within its time budget.
@pytest.fixture(
    scope="module", params=[1, 2, pytest.param(3, marks=pytest.mark.grid)], ids=lambda w: f"world{w}"
)
def measured(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    swap = str(tmp_path_factory.mktemp(f"swap{world}", numbered=True))
    return world, spawn(_grid, world, swap)


def _ids(case) -> str:
    stage, (opt, gd, par), accum, precision = case
    return f"stage{stage}-{opt}-grads_{gd}-params_{par}-accum{accum}-{precision}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_device_keeps_only_gradients_in_flight(measured, case) -> None:
    world, ranks = measured
    for got in (r[(case, True)] for r in ranks):
        assert got["staging_chunks"] > 0  # every landing went through the staging, as on a GPU
        assert got["memory"]["grads"] == 0, "a gradient shard is allocated on the device"
        assert 0 < got["peak_grad_buffers"] <= got["pending_bound"]
        assert {k: got["memory"][k] for k in KEYS} == {k: got["planned"][k] for k in KEYS}
        stage, (opt, gd, _), _, _ = case
        on_disk = opt == "nvme" and gd != "cpu"
        assert (got["memory"]["disk_grads"] > 0) == on_disk


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_landing_through_the_tier_changes_no_bit(measured, case) -> None:
    """Staged landings (GPU-like) equal in-place ones (host-only), and every tier equals the CPU tier."""
    world, ranks = measured
    stage, _, accum, precision = case
    reference = (stage, TIERS[0], accum, precision)
    for r in ranks:
        want = r[(reference, False)]
        for staged in (True, False):
            got = r[(case, staged)]
            assert got["losses"] == want["losses"]
            assert got["norms"] == want["norms"]
            for name, p in want["params"].items():
                assert torch.equal(got["params"][name], p), name


def _leaky(rank: int, world: int, swap: str) -> dict:
    return _run(rank, world, swap, True, 2, TIERS[0], 1, "fp32", leak=True)


def test_the_device_bytes_check_catches_a_gradient_left_on_the_device(tmp_path) -> None:
    """The assertion above is able to fail: an engine made to keep whole gradients on the device under CPU
    offload shows them in memory_report()["grads"], which the test above holds at 0."""
    (got,) = spawn(_leaky, 1, str(tmp_path))
    assert got["memory"]["grads"] > 0


def test_stage1_and_stage2_offload_are_one_reduction() -> None:
    """Under offload stage 1 reduces as stage 2 (no full gradient kept on the device): the same policy rules."""
    for dev in ("cpu", "nvme"):
        assert not Policy(1, dev).keeps_full_grads
        assert Policy(1, dev).receive_slices(3) == Policy(2, dev).receive_slices(3) == 1
    assert Policy(1).keeps_full_grads and Policy(1).receive_slices(3) == 2
