"""`zoff estimate` against reality: the engine's memory_report() over gloo, bytes saved for backward, design.md §1."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.harness import spawn, tiny_cfg
from zoff.config import config_from_dict, load_config
from zoff.engine import footprint as F
from zoff.engine import policy as P
from zoff.engine.precision import DTYPES
from zoff.errors import UserError
from zoff.models import build_model, lm_loss, meta_model
from zoff.planning import activations as A
from zoff.planning import choice as C
from zoff.planning import estimate as E
from zoff.planning import memory as M

REPO = Path(__file__).resolve().parents[2]

# Two GPT sizes: A is all persistent units at stage 3 (every param <= 10,000) with tied embeddings and one
# bucket; B is untied with several padded buckets, persistent and gathered units.
SIZES = {
    "A": {},
    "B": {
        "model": {"n_layer": 3, "n_head": 4, "d_model": 96, "seq_len": 32, "vocab_size": 300, "tie_embeddings": False},
        "data": {"seq_len": 32, "batch_size": 2},
        "zero": {"reduce_bucket_size": 20_000, "prefetch_bucket_size": 30_000},
    },
}  # fmt: skip
OFFLOADS = [(1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu")]


def _case(size: str, stage: int, precision: str, opt="none", par="none", ac=False, **extra) -> dict:
    sz = SIZES[size]
    zero = {
        **sz.get("zero", {}),
        "stage": stage,
        "offload_optimizer": {"device": opt},
        "offload_param": {"device": par},
    }
    train = {"precision": precision, "max_steps": 1, "grad_accum": 1, "activation_checkpointing": ac}
    return tiny_cfg(**{**sz, **extra, "zero": zero, "train": train})


CASES = (
    [_case(s, st, p) for s in SIZES for p in ("fp32", "bf16") for st in range(4)]
    + [_case(s, st, p, o, q) for s, p in (("A", "fp32"), ("B", "bf16")) for st, o, q in OFFLOADS]
    + [_case("B", 3, "bf16", ac=True), _case("B", 2, "fp32", ac=True)]
    + [_case("A", st, "fp32", model={"name": "python:tests.fixtures_models:tied_frozen"}) for st in (0, 3)]
)


def _measure(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case through the real session: build, one forward/backward/step, read memory_report()."""
    from zoff.trainer.session import build_session

    out = []
    for c in cases:
        cfg = config_from_dict(c)
        try:
            s = build_session(cfg, torch.device("cpu"))
        except UserError as e:  # an engine without CPU offload yet: its arithmetic is unit-tested below
            assert "not implemented" in str(e), e
            out.append(None)
            continue
        x, y = s.batches.micro_batch_at(0, 0)
        s.engine.model.train()
        s.engine.zero_grad()
        s.engine.backward(lm_loss(s.engine.model(x), y))
        s.engine.step(cfg.optim.lr)
        out.append(s.engine.memory_report())
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return spawn(_measure, 2, CASES)[0]


def _policy_estimate(c: dict, world: int = 2, device_type: str = "cpu") -> M.PolicyEstimate:
    cfg = config_from_dict(c)
    est = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, world, 1, device_type)
    z = cfg.zero
    pol = P.Policy(
        z.stage, z.offload_optimizer.device, z.offload_param.device, cfg.train.activation_checkpointing
    )
    return est.get(pol)


@pytest.mark.slow
def test_model_states_equal_memory_report_over_gloo(measured: list[dict]) -> None:
    assert all(
        m is not None for m, c in zip(measured, CASES) if c["zero"]["offload_optimizer"]["device"] == "none"
    )
    for c, mem in zip(CASES, measured):
        if mem is None:
            continue
        pe = _policy_estimate(c)
        got = {
            "params": pe.gpu["params"], "grads": pe.gpu["grads"], "optimizer_states": pe.gpu["optimizer_states"],
            "cpu_params": pe.cpu["params"] // 2, "cpu_grads": pe.cpu["grads"] // 2,
            "cpu_optimizer_states": pe.cpu["optimizer_states"] // 2,
        }  # fmt: skip
        want = {k: mem.get(k, 0) for k in got} | {"params": mem["params"] + mem["frozen_params"]}
        where = f"{c['model'].get('name', 'gpt')} d={c['model'].get('d_model', 32)} {pe.policy} {c['train']['precision']}"
        for k in got:
            assert abs(got[k] - want[k]) <= 0.03 * want[k], (
                f"{where} {k}: estimate {got[k]:,} vs engine {want[k]:,}"
            )
        assert got == want, where  # in fact exact: the estimate runs the engine's own partition plan


@pytest.mark.slow
def test_device_buffers_bound_the_measured_peaks(measured: list[dict]) -> None:
    """Reduce buckets and stage 3's gathered units: the estimate is an upper bound, and not a loose one."""
    for c, mem in zip(CASES, measured):
        if mem is None:
            continue
        pe = _policy_estimate(c)
        assert mem["buffers"] <= pe.gpu["buffers"], (pe.policy, mem["buffers"], pe.gpu["buffers"])
        if pe.policy.stage == 3:
            assert pe.gpu["buffers"] <= 2 * mem["buffers"], (pe.policy, mem["buffers"], pe.gpu["buffers"])


# ------------------------------------------------------------------------------------------ activations


def saved_with_tables(model: torch.nn.Module, fn) -> int:
    """A.saved_bytes of `fn()` plus the rotary tables it computes (model.positions: rotary): a checkpointed
    block's frame holds them, nested in its arguments, outside autograd's saved tensors, and they are kept for
    the recompute all the same (the estimate counts them once either way)."""
    import zoff.models.gpt as gpt

    tables: list[torch.Tensor] = []
    real = gpt.rotary_tables

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        tables.extend(out)
        return out

    with mock.patch.object(gpt, "rotary_tables", recorded):
        return A.saved_bytes(model, fn, lambda: tables)


def packed_positions(batch: int, seq: int) -> torch.Tensor:
    """Position ids of a packed micro-batch: two examples a row, the second of them restarting at 0."""
    first = seq // 3
    return torch.cat([torch.arange(first), torch.arange(seq - first)]).expand(batch, seq).contiguous()


def _saved(model_cfg: dict, batch: int, seq: int, precision: str, ac: bool, packed: bool = False) -> int:
    from zoff.data.batch import MicroBatch
    from zoff.trainer.loss import forward_loss

    cfg = config_from_dict(tiny_cfg(model=model_cfg))
    torch.manual_seed(0)
    model = build_model(cfg.model).to(DTYPES[precision]).train()
    model.activation_checkpointing = ac
    x, y = torch.randint(0, cfg.model.vocab_size, (2, batch, seq))
    mb = MicroBatch(x, y, packed_positions(batch, seq) if packed else None)
    return saved_with_tables(model, lambda: forward_loss(model, mb, 1, torch.device("cpu")))


GPTS = [
    ({"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16}, 2, 16),
    (
        {
            "n_layer": 3,
            "n_head": 4,
            "d_model": 96,
            "seq_len": 64,
            "vocab_size": 300,
            "tie_embeddings": False,
            "dropout": 0.1,
        },  # CPU attention with dropout runs the math kernel: seq^2 terms
        3,
        48,
    ),
]


# model.positions, and packed micro-batches (position ids restarting at each example: the attention mask)
POSITIONS = [("learned", False), ("rotary", False), ("learned", True), ("rotary", True)]


@pytest.mark.parametrize("positions,packed", POSITIONS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model_cfg,batch,seq", GPTS)
def test_gpt_activations_match_saved_tensors(
    model_cfg: dict, batch: int, seq: int, precision: str, positions: str, packed: bool
) -> None:
    model_cfg = {**model_cfg, "positions": positions}
    m = config_from_dict(tiny_cfg(model=model_cfg)).model
    real = {ac: _saved(model_cfg, batch, seq, precision, ac, packed) for ac in (False, True)}
    for ac in (False, True):
        est = A.gpt_activations(m, batch, seq, precision, ac, "cpu", packed=packed)
        assert abs(est.saved - real[ac]) <= 0.15 * real[ac], (ac, est.saved, real[ac])
        assert est.saved == real[ac]  # in fact exact
        if m.dropout == 0:  # the CUDA form differs only in LayerNorm statistics' dtype (fp32)
            cuda = A.gpt_activations(m, batch, seq, precision, ac, "cuda", packed=packed).saved
            assert abs(cuda - real[ac]) <= 0.15 * real[ac], (ac, cuda, real[ac])
    # With checkpointing, backward recomputes one block at a time: what a block saves beyond its input is
    # held on top of everything saved (the peak's other moments: test_activation_peaks_match_the_gpu).
    est = A.gpt_activations(m, batch, seq, precision, True, "cpu", packed=packed)
    assert est.peak - est.saved >= (real[False] - real[True]) // m.n_layer


def test_rotary_and_packing_terms_are_the_ones_measured() -> None:
    """What rotary positions and a packed micro-batch change, term by term (the test above holds the totals to
    the byte): no position ids saved, (cos, sin) tables of the compute dtype, (rows, 1, seq, head_dim) each,
    kept once, and the rotated q and k in every block; packed, a (batch, 1, seq, seq) mask in the compute dtype
    for every layer's attention and, with checkpointing, the boolean one the checkpoints keep."""
    m = config_from_dict(tiny_cfg(model=GPTS[0][0])).model
    rot = dataclasses.replace(m, positions="rotary")
    b, s, e, d, hd = 2, 16, 2, m.d_model, m.d_model // m.n_head
    est = lambda cfg, ac, packed=False: A.gpt_activations(cfg, b, s, "bf16", ac, "cpu", packed=packed).saved  # noqa: E731
    assert est(rot, False) - est(m, False) == 2 * s * hd * e - 8 * s + m.n_layer * 2 * b * s * d * e
    assert est(rot, True) - est(m, True) == 2 * s * hd * e - 8 * s
    assert est(m, False, True) - est(m, False) == m.n_layer * b * s * s * e + 8 * (b - 1) * s
    assert est(m, True, True) - est(m, True) == b * s * s + 8 * (b - 1) * s
    # (packed, the tables are per row: the positions restart within each)
    assert est(rot, True, True) - est(rot, True) == b * s * s + 2 * (b - 1) * s * hd * e


def test_rotary_positions_have_no_position_table() -> None:
    """model.positions: rotary drops the seq_len x d_model table from the parameters the estimate counts (read
    off the meta model, as the engine's partition plan is)."""
    cfg = load_config(REPO / "configs" / "gpt-7b.yaml")
    learned = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 8)
    rot = dataclasses.replace(cfg.model, positions="rotary")
    rotary = M.estimate(rot, cfg.data, cfg.train, cfg.zero, 8)
    assert learned.params - rotary.params == cfg.model.seq_len * cfg.model.d_model
    assert rotary.params == sum(p.numel() for p in meta_model(rot).parameters())
    stage3 = P.Policy(3)
    assert rotary.get(stage3).gpu["params"] < learned.get(stage3).gpu["params"]


def test_activation_peaks_match_the_gpu() -> None:
    """The estimate against the CUDA allocator (scripts/gpu_activation_check.py on an H200, kept in
    docs/results/gpu_activation_check.json): saved bytes to the allocator's rounding, and the peak, with the
    loss's and the blocks' backward moments, never under what was measured by more than that rounding and at
    most 6% over. (Before the moments were counted the peak was 0.54x the measured one for GPT-2's vocabulary:
    the shipped gpt2-124m-24gb.yaml said 15.8 GiB and allocated 28.1 GiB.)"""
    spec = importlib.util.spec_from_file_location("gac", REPO / "scripts" / "gpu_activation_check.py")
    gac = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gac)
    rows = json.loads(gac.JSON.read_text())["results"]
    assert len(rows) >= 10 and not any("error" in r for r in rows)
    slack = 8 << 20  # the caching allocator rounds each block (512 B; 2 MiB segments for large ones)
    for r in rows:
        est = gac.current_estimate(r)
        assert abs(est.saved - r["measured_saved"]) <= 0.01 * r["measured_saved"] + slack, r
        assert r["measured_peak"] - slack <= est.peak <= 1.06 * r["measured_peak"], (est.peak, r)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt_activations_with_a_tiled_loss_match_saved_tensors(precision: str) -> None:
    """train.loss_tile: no logits are saved (the tail's 4 B x vocabulary per token goes), and backward
    recomputes one tile's logits at a time (the peak's extra term)."""
    from zoff.data.batch import MicroBatch
    from zoff.trainer.loss import forward_loss

    model_cfg, batch, seq, tile = (
        {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 300},
        2,
        16,
        5,
    )
    m = config_from_dict(tiny_cfg(model=model_cfg)).model
    torch.manual_seed(0)
    model = build_model(m).to(DTYPES[precision]).train()
    x, y = torch.randint(0, m.vocab_size, (2, batch, seq))
    real = A.saved_bytes(model, lambda: forward_loss(model, MicroBatch(x, y), 1, torch.device("cpu"), tile))
    est = A.gpt_activations(m, batch, seq, precision, False, "cpu", loss_tile=tile)
    assert est.saved == real
    untiled = A.gpt_activations(m, batch, seq, precision, False, "cpu")
    assert untiled.saved - est.saved == batch * seq * 4 * m.vocab_size + 4  # the logits, the scalar loss
    e, d = (
        DTYPES[precision].itemsize,
        m.d_model,
    )  # one tile's recompute and gradients, the head's weight gradient
    assert est.peak - est.saved == tile * m.vocab_size * 12 + m.vocab_size * d * e + batch * seq * d * e


def test_probe_measures_any_model_on_the_meta_device() -> None:
    """A python: model (tied and frozen weights): the meta-device probe equals a real forward's saved bytes."""
    model_cfg = {"name": "python:tests.fixtures_models:tied_frozen", "d_model": 48}
    m = config_from_dict(tiny_cfg(model=model_cfg)).model
    est = A.probe_activations(m, 3, 20, "fp32", False)
    assert est.method.startswith("measured: meta-device forward")
    torch.manual_seed(0)
    model = build_model(m).train()
    x, y = torch.randint(0, m.vocab_size, (2, 3, 20))
    assert est.saved == A.saved_bytes(model, lambda: lm_loss(model(x), y))


# ---------------------------------------------------------------------------------- design.md §1 arithmetic


def _states(stage: int, n: int, opt="none", par="none", device_type="cuda", clip=False, precision="bf16"):
    cfg = config_from_dict(
        tiny_cfg(
            model={"n_layer": 4, "d_model": 256, "n_head": 4, "tie_embeddings": False},
            zero={"param_persistence_threshold": 0},
        )
    )
    model = meta_model(cfg.model)
    psi = M.count_params(model)[1]
    plan = P.engine_plan(model, stage, n, cfg.zero)
    gpu, cpu = F.model_states(
        plan, P.Policy(stage, opt, par), precision, device_type=device_type, fp32_grad_staging=clip
    )
    return psi, gpu, cpu


@pytest.mark.parametrize("n", [2, 4, 8])
def test_model_states_follow_the_zero_table(n: int) -> None:
    for stage, per_param in {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}.items():
        psi, gpu, cpu = _states(stage, n)
        assert sum(gpu.values()) == pytest.approx(per_param * psi, rel=1e-3), stage
        assert sum(cpu.values()) == 0


def test_offload_arithmetic() -> None:
    n = 4
    # ZeRO-Offload, stage 2: the device keeps only its 16-bit params; the host the fp32 master + m + v (12 B)
    # and the reduced gradient shard (2 B: it leaves the device as each reduction finishes; clipping
    # rescales it unit by unit, so no fp32 copy of it exists).
    psi, gpu, cpu = _states(2, n, "cpu")
    assert gpu == {"params": pytest.approx(2 * psi, rel=1e-3), "grads": 0, "optimizer_states": 0}
    assert cpu["optimizer_states"] == pytest.approx(12 * psi / n, rel=1e-3)
    assert cpu["grads"] == pytest.approx(2 * psi / n, rel=1e-3)
    assert _states(2, n, "cpu", clip=True)[2]["grads"] == cpu["grads"]
    # Stage 1 under offload reduces as stage 2: the same bytes, no full gradient on the device.
    assert _states(1, n, "cpu")[1:] == (gpu, cpu)
    # Stage 3 with both offloads: the 16-bit param shards move to the host as well; the device holds nothing
    # that grows with the partition.
    psi, gpu, cpu = _states(3, n, "cpu", "cpu")
    assert gpu == {"params": 0, "grads": 0, "optimizer_states": 0}
    assert sum(cpu.values()) == pytest.approx((2 + 2 + 12) * psi / n, rel=1e-3)
    # fp32 on a CPU-only machine: the host is the device, so no master copy; the gradient shard is the host's.
    psi, gpu, cpu = _states(2, n, "cpu", device_type="cpu", precision="fp32")
    assert cpu == {"params": 0, "grads": pytest.approx(4 * psi / n, rel=1e-3),
                   "optimizer_states": pytest.approx(8 * psi / n, rel=1e-3)}  # fmt: skip
    assert gpu["grads"] == 0


def test_cpu_memory_is_summed_per_node_not_over_all_gpus() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    one = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 4, 1)
    two = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 4, 2)
    pol = P.Policy(2, "cpu")
    plan = P.engine_plan(meta_model(cfg.model), 2, 8, cfg.zero)
    _, per_rank = F.model_states(plan, pol, cfg.train.precision)
    staging = F.host_staging(pol, cfg.zero, "cuda")  # each rank's bounded pinned buffers (engine/staging.py)
    assert staging == 64 << 20
    # (speculate auto's second buffers on a GPU host take only what the host budget leaves: not in the column)
    assert "speculation" not in two.get(pol).cpu
    assert two.world_size == 8 and two.get(pol).cpu_bytes_per_node == 4 * (sum(per_rank.values()) + staging)
    assert two.get(pol).pinned == staging  # offloaded optimizer states stay pageable
    assert two.get(pol).cpu_bytes_per_node < one.get(pol).cpu_bytes_per_node  # 8 shards, 4 of them per node


# ------------------------------------------------------------------------------------------- suggestions

GIB = 2**30


@pytest.mark.parametrize(
    "config,gpus,gpu_gib,cpu_gib,expected",
    [
        ("tiny.yaml", 2, 80, 64, (0, "none", "none", False)),  # everything fits: plain data parallel
        ("gpt-7b.yaml", 8, 80, 512, (1, "none", "none", False)),  # 8 x 80 GB: Adam states sharded
        ("gpt-7b.yaml", 8, 40, 512, (1, "none", "none", True)),  # 40 GB: recompute before sharding more
        ("gpt-7b.yaml", 8, 24, 512, (2, "cpu", "none", True)),  # 24 GB: ZeRO-Offload
        # 16 GB: ZeRO-Offload still fits, its gradient shard living on the host (it used to take stage 3)
        ("gpt-7b.yaml", 8, 16, 512, (2, "cpu", "none", True)),
        ("gpt-7b.yaml", 1, 80, 512, (2, "cpu", "none", False)),  # one GPU: the ZeRO-Offload paper's case
        # 70B with accumulation on 16: stage 3 fits without offload once each Linear is gathered alone
        # (the estimate's own choice, memory.fit_gathering; whole layers need optimizer offload)
        ("gpt-70b.yaml", 16, 80, 1024, (3, "none", "none", True)),
        # on 8, stage 3's fp32 gradient accumulator (4 B/param/N) needs optimizer offload
        ("gpt-70b.yaml", 8, 80, 1024, (3, "cpu", "none", True)),
        # 48 GB: the fp32 gradient accumulator lives on the host, so optimizer offload alone fits (it used to
        # take parameter offload too)
        ("gpt-70b.yaml", 8, 48, 2048, (3, "cpu", "none", True)),
        ("gpt-70b.yaml", 8, 24, 2048, (3, "cpu", "cpu", True)),  # 24 GB: parameter offload as well
    ],
)
def test_suggest_policy(config: str, gpus: int, gpu_gib: int, cpu_gib: int, expected: tuple) -> None:
    cfg = load_config(REPO / "configs" / config)
    got = C.resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, gpus, gpu_gib * GIB, cpu_gib * GIB)
    assert got[:4] == expected, got[4]
    assert got[5] == ({"block_classes": ("Linear",)} if (config, gpus) == ("gpt-70b.yaml", 16) else {})
    assert got[4].startswith(C.policy_label(P.Policy(*expected))) and "\n" not in got[4]


HEADLINE_BOXES = [  # (config, overrides, GPUs, GiB per GPU, CPU GiB per node)
    ("gpt-7b.yaml", [], 1, 24, 256),  # 6.7B on one 24 GiB GPU
    (
        "gpt-7b.yaml",
        ["model.n_layer=40", "model.d_model=5120", "model.n_head=40"],
        1,
        32,
        512,
    ),  # 13B, V100 32 GB
    ("gpt-70b.yaml", [], 8, 24, 2048),  # 65B on 8 GPUs
]


@pytest.mark.parametrize("config,overrides,gpus,gpu_gib,cpu_gib", HEADLINE_BOXES)
def test_offload_keeps_the_gradient_shard_off_the_gpu(config, overrides, gpus, gpu_gib, cpu_gib) -> None:
    """ZeRO-Offload's headline boxes: with the gradient shard in host memory, zero2-offload and zero3-offload
    (with activation checkpointing, as the configs run) fit, zero3-offload in under 8 GiB per GPU on one GPU
    and under 24 GiB on eight; no offload policy puts a gradient byte on the GPU."""
    cfg = load_config(REPO / "configs" / config, overrides)
    est = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, gpus)
    budget = M.Budget(gpu_gib * GIB, cpu_gib * GIB)
    z2, z3 = est.get(P.Policy(2, "cpu", "none", True)), est.get(P.Policy(3, "cpu", "cpu", True))
    assert z3.fits(budget) and z3.gpu_bytes < (8 if gpus == 1 else 24) * GIB
    if gpus == 1:
        assert z2.fits(budget)
    for pe in est.policies:
        if pe.policy.offloads_optimizer:
            assert pe.gpu["grads"] == 0, pe.policy.name
            assert pe.cpu["grads"] > 0 or pe.disk_grads > 0, pe.policy.name
    # zero1-offload reduces as zero2-offload does: the same device bytes (it used to need less at N=1)
    z1 = est.get(P.Policy(1, "cpu", "none", True))
    assert z1.gpu == z2.gpu and z1.cpu == z2.cpu


def test_suggest_policy_when_nothing_fits() -> None:
    cfg = load_config(REPO / "configs" / "gpt-70b.yaml")
    with pytest.raises(UserError, match="no policy fits"):
        C.resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, 1, 8 * GIB, 64 * GIB)


# ------------------------------------------------------------------------------------------------- CLI


def _zoff(*args: str, rss: bool = False) -> subprocess.CompletedProcess:
    """`python -m zoff ARGS`; with rss, through a wrapper that appends the child's peak RSS (KiB) to stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "zoff", *args]
    if rss:
        wrap = (
            "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print('maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(p.returncode)"
        )
        cmd = [sys.executable, "-c", wrap, *cmd]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def _gpt_params(m) -> int:
    d, v = m.d_model, m.vocab_size
    return v * d * (1 if m.tie_embeddings else 2) + m.seq_len * d + m.n_layer * (12 * d * d + 13 * d) + 2 * d


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-7b.yaml", "gpt-70b.yaml"])
def test_cli_big_configs_without_materialising(name: str) -> None:
    t0 = time.perf_counter()
    p = _zoff(
        "estimate", f"configs/{name}", "--json", "--gpus-per-node", "8", "--gpu-memory", "80GB", rss=True
    )
    elapsed = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    cfg = load_config(REPO / "configs" / name)
    assert out["params"] == out["trainable_params"] == _gpt_params(cfg.model)
    # stage 0; 1-2 x {on device, cpu, nvme}; 3 x {on device, cpu, nvme} x params {device, cpu} but none+cpu,
    # and nvme+nvme; each with and without activation checkpointing
    assert out["world_size"] == 8 and len(out["policies"]) == 26
    for pol in out["policies"]:
        assert pol["gpu_bytes"] == sum(pol["gpu"].values()) and set(pol["gpu"]) == set(M.GPU_KEYS)
        assert (pol["disk_bytes_per_node"] > 0) == (pol["offload_optimizer"] == "nvme")
        assert pol["cpu_bytes_per_node"] == sum(pol["cpu"].values())
    assert sum(pol["configured"] for pol in out["policies"]) == 1
    maxrss_kib = int(p.stderr.split("maxrss")[-1])
    assert maxrss_kib < 1024 * 1024, f"peak RSS {maxrss_kib / 1024:.0f} MiB: the model must stay on meta"
    assert elapsed < 60, elapsed  # a few seconds on an idle machine; bounded loosely for a busy CI box


def test_table_marks_the_configured_policy(capsys) -> None:
    E.run_cli(REPO / "configs/tiny.yaml", ["zero=zero2"], None, None, "16GiB", "32GiB", False, True)
    out = capsys.readouterr().out
    assert "▶ zero2 " in out and "suggested: zero0:" in out and "builtin GPT closed form" in out


def test_cli_bad_input_is_one_line_exit_2() -> None:
    p = _zoff("estimate", "configs/tiny.yaml", "--gpus-per-node", "0")
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("zoff: error: --gpus-per-node: "), p.stderr


@pytest.mark.parametrize(
    "flags,overrides,flag",
    [
        ({"gpus_per_node": "0"}, [], "--gpus-per-node"),
        ({"gpus_per_node": "-3"}, [], "--gpus-per-node"),
        ({"nodes": "two"}, [], "--nodes"),
        ({"gpu_memory": "lots"}, [], "--gpu-memory"),
        ({"gpu_memory": "12KB"}, [], "--gpu-memory"),
        ({"cpu_memory": "9e30"}, [], "--cpu-memory"),
        ({"cpu_memory": "1e400"}, [], "--cpu-memory"),
        ({}, ["zero.stage=7"], "zero.stage"),
    ],
)
def test_bad_input_names_the_flag(flags: dict, overrides: list[str], flag: str) -> None:
    """The CLI's main() turns these UserErrors into one stderr line and exit 2 (checked above)."""
    args = {"gpus_per_node": None, "nodes": None, "gpu_memory": None, "cpu_memory": None} | flags
    with pytest.raises(UserError) as e:
        E.run_cli(REPO / "configs/tiny.yaml", overrides, **args, as_json=True, suggest=False)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_parse_size() -> None:
    assert E.parse_size("80GB", "--gpu-memory") == 80 * 10**9
    assert E.parse_size("24GiB", "--gpu-memory") == 24 * GIB
    assert E.parse_size("1.5T", "--cpu-memory") == 1_500_000_000_000
