"""The estimate under train.sequence_parallel N (issue 55) against what the ranks allocate at N = 2 over gloo:
the bytes kept for backward on each rank equal gpt_activations' to the byte, with learned or rotary positions
and packed micro-batches; the all-to-all's buffers (what ulysses_attention allocates beyond its inputs) equal
the closed form's; and the live bytes at every exchange, forward, recomputed and in backward, stay under the
estimated peak, the largest of them within a few percent of the exchanges' estimated moment. The model states
and buffers the engine reports at N = 2 are the estimate's (ZeRO partitions over the whole world, whatever N);
a transformers Llama's exchange buffers are probe_exchange's."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import json
import threading
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from tests.harness import spawn, tiny_cfg
from zoff.config import config_from_dict, load_config
from zoff.engine.precision import DTYPES
from zoff.models import packed_attention as PA
from zoff.planning import activations as A
from zoff.planning import memory as M

N = 2
MODEL = {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 256, "vocab_size": 64, "tie_embeddings": False}
# (model.positions, precision, checkpointing, sequences per micro-batch, loss and MLP tile, dropout, packed: None,
# or two examples a row attending through a mask, or one by one as packed rows past MASK_LIMIT do)
CASES = [
    (pos, "bf16", ac, b, tile, 0.0, None)
    for pos, ac, b, tile in itertools.product(("learned", "rotary"), (False, True), (1, 2), (0, 8))
]
CASES += [(pos, "fp32", False, 2, 0, 0.0, None) for pos in ("learned", "rotary")]
CASES += [("learned", "fp32", True, 1, 8, 0.0, None)]
CASES += [
    (pos, "bf16", ac, 2, 0, 0.0, packed)
    for pos, ac, packed in itertools.product(("learned", "rotary"), (False, True), ("mask", "examples"))
]
CASES += [
    ("learned", "fp32", False, 2, 0, 0.1, None),
    ("rotary", "bf16", True, 1, 0, 0.1, None),
]  # CPU attention with dropout: the math kernel


class Live(TorchDispatchMode):
    """Bytes of the storages op outputs hold while they live (a CPU allocator's view of one process): each new
    storage counts until its last tensor is gone. most() is the most held since the mark() it closes (marks
    nest: an exchange's inside ulysses_attention's). (gloo's threads may drop a collective's last reference:
    the counts are updated under a lock.)"""

    def __init__(self) -> None:
        super().__init__()
        self.seen: weakref.WeakKeyDictionary = (
            weakref.WeakKeyDictionary()
        )  # storages counted, while they live
        self.lock = threading.Lock()
        self.now = 0
        self.windows: list[int] = []  # the most held since each open mark()

    def _free(self, nbytes: int) -> None:
        with self.lock:
            self.now -= nbytes

    def mark(self) -> int:
        with self.lock:
            self.windows.append(self.now)
            return self.now

    def most(self) -> int:
        with self.lock:
            return self.windows.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (a view or an in-place result shares an input's storage: nothing new, and the parameters' own
        # storages, made before, are never counted)
        inputs = [t.untyped_storage() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                if s in self.seen or any(s is i for i in inputs) or not s.nbytes():
                    continue
                self.seen[s] = True
                with self.lock:
                    self.now += s.nbytes()
                weakref.finalize(s, self._free, s.nbytes())
        with self.lock:
            self.windows = [max(w, self.now) for w in self.windows]
        return out


def _model_cfg(positions: str, dropout: float):
    return config_from_dict(tiny_cfg(model={**MODEL, "positions": positions, "dropout": dropout})).model


def _watching() -> tuple[Live, list[tuple[str, int, int]]]:
    """A Live mode, and the calls it records: each exchange's (name, bytes live at its entry, most bytes live
    inside it), ulysses_attention's (eager_attention looks it up in its module when a model is split) and the
    all-to-alls' own (_to_heads, _to_tokens: the autograd functions look them up in their module, forward and
    backward)."""
    import zoff.models.ulysses as U

    mode, calls = Live(), []

    def watched(module, name: str) -> None:
        real = getattr(module, name)

        def call(*args, **kwargs):
            entry = mode.mark()
            out = real(*args, **kwargs)
            calls.append((name, entry, mode.most()))
            return out

        setattr(module, name, call)

    for name in ("ulysses_attention", "_to_heads", "_to_tokens"):
        watched(U, name)
    for name in ("all_to_all_single", "all_gather"):
        setattr(U.dist, name, _released(getattr(U.dist, name)))
    return mode, calls


def _measure(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Per case, on this rank (_case): the bytes kept for backward, and the exchanges (_watching's) in a
    forward and backward."""
    import zoff.models.ulysses as U

    group = U.sequence_group(world)
    mode, calls = _watching()
    return [{"saved": _case(rank, group, c, mode, calls), "calls": list(calls)} for c in cases]


def _released(collective):
    """`collective` run on copies made with the mode off. gloo's worker threads hold the tensors they are given a
    moment after the call returns (aliases of them too); a counted buffer whose last reference went on such a
    thread would be counted free only when that thread next takes the GIL (Live's finalizer runs there): late,
    by timing. The copies are never counted, and the caller's tensors are read and written on this thread only
    (gloo's own buffers are no more counted than before: the mode sees ops, not the library's memory)."""

    def call(output, *args, **kwargs):  # (all_to_all_single's output tensor, all_gather's list: written back)
        flat, spec = tree_flatten((output, args, kwargs))
        with _disable_current_modes():
            copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in flat]
            out_copy, a, kw = tree_unflatten(copies, spec)
            out = collective(out_copy, *a, **kw)
            for t, c in zip(tree_flatten(output)[0], tree_flatten(out_copy)[0], strict=True):
                t.copy_(c)
        return out

    return call


PLAN = PA.attention_plan


def _case(rank: int, group, case: tuple, mode: Live, calls: list) -> int:
    """The builtin GPT split over the group as the session splits it, one micro-batch's shard (copied, as to a
    device); the bytes it keeps for backward, then its forward and backward under `mode`. Weight gradients are
    dropped as they arrive (the engine takes them: model states, not activations)."""
    import zoff.models.ulysses as U
    from tests.integration.test_estimate import packed_positions, saved_with_tables
    from zoff.data.batch import MicroBatch
    from zoff.models import build_model
    from zoff.models.sequence_split import split_attention
    from zoff.models.tiling import tile_mlps
    from zoff.trainer.loss import forward_loss

    positions, precision, ac, batch, tile, dropout, packed = case
    torch.manual_seed(0)
    model = build_model(_model_cfg(positions, dropout)).to(DTYPES[precision]).train()
    model.activation_checkpointing = ac
    if tile:
        tile_mlps(model, tile)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    split_attention(model, group)
    seq = MODEL["seq_len"]
    ids = torch.randint(0, MODEL["vocab_size"], (2, batch, seq), generator=torch.Generator().manual_seed(1))
    mb = MicroBatch(*ids, packed_positions(batch, seq) if packed else None).shard(group.index, group.size)
    # (past the limit each example attends alone; the estimate is asked at the same limit)
    U.attention_plan = functools.partial(PLAN, limit=0 if packed == "examples" else PA.MASK_LIMIT)
    mb = MicroBatch(mb.inputs.clone(), mb.targets.clone(), mb.position_ids.clone())
    torch.manual_seed(rank)
    saved = saved_with_tables(model, lambda: forward_loss(model, mb, 1, torch.device("cpu"), tile))
    calls.clear()  # (those of the forward above)
    _under(mode, model, mb, tile)
    return saved


def _under(mode: Live, model, mb, tile: int = 0) -> None:
    """The micro-batch's forward and backward under `mode`, without the garbage collector: a collection at a
    random moment would free garbage of earlier ops inside a window."""
    from zoff.trainer.loss import forward_loss

    gc.collect()
    gc.disable()
    try:
        with mode:
            forward_loss(model, mb, 1, torch.device("cpu"), tile).backward()
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    return spawn(_measure, N, CASES)


def _estimate(positions: str, precision: str, ac: bool, batch: int, tile: int, dropout: float, packed):
    m = _model_cfg(positions, dropout)
    with mock.patch.object(PA, "MASK_LIMIT", 0 if packed == "examples" else PA.MASK_LIMIT):
        return A.gpt_activations(
            m, batch, m.seq_len, precision, ac, "cpu", tile, False, tile, False, N, packed is not None
        )


def _id(i: int) -> str:
    return "-".join(map(str, CASES[i]))


@pytest.mark.parametrize("case", range(len(CASES)), ids=_id)
def test_each_rank_saves_what_the_estimate_says(measured, case: int) -> None:
    est = _estimate(*CASES[case])
    for rank in measured:
        assert rank[case]["saved"] == est.saved
    positions, precision, ac, batch, _, dropout, packed = CASES[case]
    one = A.gpt_activations(
        _model_cfg(positions, dropout), batch, MODEL["seq_len"], precision, ac, "cpu", packed=bool(packed)
    )
    assert est.saved < one.saved  # (each rank saves about half of what one rank of the whole sequence would)


@pytest.mark.parametrize("case", range(len(CASES)), ids=_id)
def test_the_exchange_buffers_and_the_moment_they_make(measured, case: int) -> None:
    """ulysses_attention allocates, beyond what it is handed, the send buffer q, k and v are copied into and
    the receive buffer (3d per token of the rank each; the send buffer goes before the received one is laid
    out into the rank's heads), then the gathered positions (8 B x seq per row, and 0..seq-1 to compare them
    with): the closed form's buffers. The exchanges' moment is the last layer's, in backward (the gradients of
    q, k and v, their contiguous copies, the buffers): the most live at any exchange, forward, recomputed or
    backward, is the estimate's to a few percent and never over it. Packed, the mask comes on top inside
    ulysses_attention, under the estimated peak."""
    positions, precision, ac, batch, tile, dropout, packed = CASES[case]
    est = _estimate(*CASES[case])
    d, e, seq = MODEL["d_model"], DTYPES[precision].itemsize, MODEL["seq_len"]
    buffers = 2 * 3 * d * e * batch * seq // N
    assert est.exchange == buffers
    for rank in measured:
        calls = rank[case]["calls"]
        attention = [(entry, inside) for name, entry, inside in calls if name == "ulysses_attention"]
        assert len(attention) == MODEL["n_layer"] * (2 if ac else 1)  # (the recompute's calls too)
        # each attention's two, and a layer's two in backward
        assert len(calls) - len(attention) == 2 * len(attention) + 2 * MODEL["n_layer"]
        if dropout:  # CPU attention with dropout runs the math kernel, whose fp32 scores come on top; the
            continue  # estimate has flash kernels' moments (docs/results/gpu_activation_check.json)
        most = max(inside for _, _, inside in calls)
        assert most <= est.peak
        if packed:
            continue
        for entry, inside in attention:
            assert buffers <= inside - entry <= buffers + 8 * seq * (2 * batch + 1), [
                i - e for e, i in attention
            ]
        assert 0.95 * est.exchange_peak <= most <= est.exchange_peak


# ------------------------------------------------------------------------------------------ model states

STATES = [  # (zero section, precision): the states do not depend on N; the micro-batch count does
    ({"stage": 2}, "fp32"),
    ({"stage": 3, "param_persistence_threshold": 64, "offload_optimizer": {"device": "cpu"}}, "bf16"),
]


def _states_cfg(zero: dict, precision: str) -> dict:
    return tiny_cfg(
        model={**MODEL, "seq_len": 32, "vocab_size": 256}, data={"seq_len": 32, "batch_size": 1},
        train={"precision": precision, "max_steps": 1, "global_batch_size": 2, "sequence_parallel": N},
        zero=zero,
    )  # fmt: skip


def _engine_report(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    """Each config through the real session at N = 2: one step over both micro-batches, memory_report()."""
    from zoff.trainer.loss import forward_loss
    from zoff.trainer.session import build_session

    out = []
    for c in cfgs:
        cfg = config_from_dict(c)
        s = build_session(cfg, torch.device("cpu"))
        s.engine.model.train()
        s.engine.zero_grad()
        for micro in range(2):
            mb = s.batches.micro_batch_at(0, micro)
            s.engine.backward(forward_loss(s.engine.model, mb, 2, torch.device("cpu")))
        s.engine.step(cfg.optim.lr)
        out.append(s.engine.memory_report())
    return out


def test_model_states_at_n_2_equal_the_estimate_and_the_world_shards_them() -> None:
    """ZeRO partitions over both ranks though they train one sequence: the engine's states equal the estimate
    of world 2 at N = 2, which are those of N = 1; the micro-batches per step are the global batch over the
    data-parallel ranks (one: two micro-batches, which accumulate)."""
    cfgs = [_states_cfg(*c) for c in STATES]
    reports = spawn(_engine_report, N, cfgs)
    for i, c in enumerate(cfgs):
        cfg = config_from_dict(c)
        est = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, N, 1, "cpu")
        pe = est.get(M.Policy.of(cfg.zero, cfg.train.activation_checkpointing))
        # N = 1 with as many micro-batches a step (two data ranks: a global batch of 4)
        unsplit = dataclasses.replace(cfg.train, sequence_parallel=1, global_batch_size=4)
        one = M.estimate(cfg.model, cfg.data, unsplit, cfg.zero, N, 1, "cpu").get(pe.policy)
        assert est.sequence_parallel == N and pe.gpu["activations"] < one.gpu["activations"]
        assert {k: v for k, v in pe.gpu.items() if k != "activations"} == {
            k: v for k, v in one.gpu.items() if k != "activations"
        }
        assert pe.cpu == one.cpu
        for mem in (r[i] for r in reports):
            got = {"params": pe.gpu["params"], "grads": pe.gpu["grads"], "optimizer_states": pe.gpu["optimizer_states"],
                   "cpu_optimizer_states": pe.cpu["optimizer_states"] // N}  # fmt: skip
            want = {k: mem.get(k, 0) for k in got} | {"params": mem["params"] + mem["frozen_params"]}
            assert got == want, pe.policy
            assert mem["buffers"] <= pe.gpu["buffers"]


# ------------------------------------------------------------------------------------------------- CLI


def test_zoff_estimate_takes_n_from_the_config_and_refuses_a_bad_one_in_one_line() -> None:
    """`train.sequence_parallel=8` as an override: the JSON's bytes are a rank's at N = 8 (the same estimate()
    tests hold above); an N that does not divide the world is one line and exit 2."""
    from tests.forked_zoff import zoff_run

    repo = Path(__file__).resolve().parents[2]
    box = ["--gpus-per-node", "8", "--gpu-memory", "80GiB", "--cpu-memory", "2TiB", "--disk", "0"]
    run = lambda *extra: zoff_run(["estimate", "configs/gpt-7b.yaml", *box, *extra], cwd=repo)  # noqa: E731
    good = run("--json", "train.sequence_parallel=8", "data.batch_size=1")
    assert good.returncode == 0, good.stderr
    got = json.loads(good.stdout)
    cfg = load_config(repo / "configs" / "gpt-7b.yaml", ["train.sequence_parallel=8", "data.batch_size=1"])
    est = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 8, 1, "cuda", 2048 << 30)
    assert got["sequence_parallel"] == 8 and got["exchange_bytes"] == est.exchange == 6 * 4096 // 8 * 4096 * 2
    bad = run("train.sequence_parallel=16")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "zoff: error: train.sequence_parallel: 16 does not divide the world size 8 (8 GPU(s) per node x 1 "
        "node(s); each group of 16 ranks trains the same sequences)"
    ), bad.stderr


# ------------------------------------------------------------------------------------ transformers models

LLAMAS = [  # (heads, key/value heads): replicated to N before the exchange; repeated up to the query heads after
    (2, 1),
    (8, 2),
]


def _llama(heads: int, kv: int) -> dict:
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": 256, "max_position_embeddings": 64}  # fmt: skip
    return tiny_cfg(
        model={"name": "hf:LlamaForCausalLM", "config": config}, data={"seq_len": 64, "batch_size": 2}
    )


def _hf_exchanges(rank: int, world: int, cfgs: list[dict]) -> list[list[tuple[str, int, int]]]:
    """Each Llama split over the group, one micro-batch's shard forward and backward: the exchanges
    (_watching's)."""
    import zoff.models.ulysses as U
    from zoff.data.batch import MicroBatch
    from zoff.models import build_model
    from zoff.models.sequence_split import split_attention

    group = U.sequence_group(world)
    mode, calls = _watching()
    out = []
    for c in cfgs:
        cfg = config_from_dict(c)
        torch.manual_seed(0)
        model = build_model(cfg.model).train()
        split_attention(model, group)
        shape = (2, cfg.data.batch_size, cfg.data.seq_len)
        mb = MicroBatch(*torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(1)))
        calls.clear()
        _under(mode, model, mb.shard(group.index, group.size))
        out.append(list(calls))
    return out


def test_a_transformers_models_exchange_buffers_are_probe_exchanges() -> None:
    """A Llama with one key/value head (replicated to both ranks before the exchange) and one with GQA (its
    key/value heads repeated up to the rank's query heads after it): the most ulysses_attention holds beyond
    its inputs is the estimate's exchange buffers (plus the gathered positions at the first layer), and every
    exchange, forward and backward, is under the estimated peak."""
    cfgs = [_llama(*heads) for heads in LLAMAS]
    measured = spawn(_hf_exchanges, N, cfgs)
    for i, c in enumerate(cfgs):
        cfg = config_from_dict(c)
        act = A.activations(cfg.model, cfg.data, "fp32", False, "cpu", sequence_parallel=N)
        seq, batch = cfg.data.seq_len, cfg.data.batch_size
        for calls in (rank[i] for rank in measured):
            attention = [(entry, inside) for name, entry, inside in calls if name == "ulysses_attention"]
            assert len(attention) == 2 and len(calls) == 2 + 2 * 2 + 2 * 2
            for entry, inside in attention:
                assert act.exchange <= inside - entry <= act.exchange + 8 * seq * (2 * batch + 1), LLAMAS[i]
            assert max(inside for _, _, inside in calls) <= act.peak
