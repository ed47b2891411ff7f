"""The estimate's side of train.sequence_parallel N (issue 55): a rank's bytes at N, the one-line refusal of an N
that does not split the model on the world, --max-context at N (to 32M tokens), and the N that --suggest and
`zero: auto` choose where no policy fits one sequence. The bytes themselves are held to the ranks' allocations
in tests/integration/test_sequence_parallel_estimate.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from zoff.config import load_config
from zoff.engine.policy import Policy
from zoff.errors import UserError
from zoff.planning import choice as C
from zoff.planning import context as X
from zoff.planning import memory as M
from zoff.planning import sequence as S

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
LONG = ["data.batch_size=1", "train.loss_tile=4096", "train.mlp_tile=4096", "train.activation_offload=true"]
BOX = M.Budget(80 * GIB, 2048 * GIB)  # 8 x 80 GiB, 2 TiB of RAM


def _gpt7b(seq: int, *extra: str):
    return load_config(
        REPO / "configs" / "gpt-7b.yaml", [*LONG, f"model.seq_len={seq}", f"data.seq_len={seq}", *extra]
    )


def test_a_rank_holds_1_over_n_of_the_tokens_and_the_whole_worlds_shards() -> None:
    """At N = 8 the activations are a rank's 1/8 of the sequence plus the all-to-all's moment; the model states
    and the stage-3 buffers are N = 1's (ZeRO shards over the same 8 ranks); one step is 8 times as many
    micro-batches a rank for the same global batch."""
    cfg = _gpt7b(262144, "train.global_batch_size=8")
    split = dataclasses.replace(cfg.train, sequence_parallel=8)
    one = M.estimate(cfg.model, cfg.data, cfg.train, cfg.zero, 8, 1, "cuda", BOX.cpu)
    est = M.estimate(cfg.model, cfg.data, split, cfg.zero, 8, 1, "cuda", BOX.cpu)
    # (q, k and v copied into the send buffer, and the receive buffer: 6 x d_model bf16 values a token of the
    # rank's 32K)
    assert (est.sequence_parallel, one.sequence_parallel, one.exchange) == (8, 1, 0)
    assert est.exchange == 6 * 4096 * 2 * 262144 // 8
    pol = Policy(3, "cpu", "cpu", True)
    a, b = one.get(pol), est.get(pol)
    assert {k: v for k, v in a.gpu.items() if k != "activations"} == {
        k: v for k, v in b.gpu.items() if k != "activations"
    }
    # the inputs the checkpointed blocks keep in host memory: exactly 1/8 of N = 1's
    assert b.cpu["activations"] * 8 == a.cpu["activations"]
    assert b.gpu["activations"] < a.gpu["activations"] / 4
    # (N = 1: 1 micro-batch of the 8 sequences a rank; N = 8: one group trains all 8, 8 micro-batches: the
    # gradient accumulator is there)
    assert est.get(Policy(2)).gpu["buffers"] > one.get(Policy(2)).gpu["buffers"]


@pytest.mark.parametrize(
    ("n", "gpus", "nodes", "says"),
    [
        (
            16,
            8,
            1,
            "train.sequence_parallel: 16 does not divide the world size 8 (8 GPU(s) per node x 1 node(s)",
        ),
        (3, 6, 1, "train.sequence_parallel: 3 does not divide data.seq_len 4096"),
        (64, 64, 1, "train.sequence_parallel: 64 does not divide the model's 32 attention heads"),
    ],
)
def test_an_n_that_does_not_split_the_model_is_one_line(n: int, gpus: int, nodes: int, says: str) -> None:
    cfg = _gpt7b(4096)
    train = dataclasses.replace(cfg.train, sequence_parallel=n)
    with pytest.raises(UserError) as e:
        M.estimate(cfg.model, cfg.data, train, cfg.zero, gpus, nodes, "cuda", BOX.cpu)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="does not divide"):
        X.max_context(cfg.model, cfg.data, train, cfg.zero, BOX, gpus, nodes)


def test_the_choices_divide_the_world_seq_len_and_heads() -> None:
    wide = ["model.n_head=48", "model.d_model=6144"]
    model = M.shapes(_gpt7b(3 * 4096, *wide).model)
    assert S.choices(model, 3 * 4096, 1, 48, 1) == [2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert S.choices(model, 3 * 4096, 1, 8, 8) == [2, 4, 8, 16]  # (the 48 heads: not 32 or 64)
    assert S.choices(model, 8192, 1, 48, 1) == [2, 4, 8, 16]  # (the sequence: not 3)
    assert S.choices(model, 3 * 4096, 2, 8, 6) == [4, 6, 8, 12, 16, 24, 48]  # multiples of the configured N
    assert S.refusal(model, 3 * 4096, 1, 7, 1) is None


def test_max_context_at_n_searches_multiples_of_n_up_to_32m() -> None:
    """The ladder reaches 32M tokens; at N = 8 on 8 GPUs each answer fits by estimate() at that length and one
    step more does not, and beats N = 1's on the same box (each rank holds 1/8 of the sequence)."""
    assert X.LADDER[-1] == 32 * 2**20 and X.step_of(8) == X.STEP and X.step_of(3) == 3 * X.STEP
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["data.batch_size=1", "train.loss_tile=64"])
    split = dataclasses.replace(cfg.train, sequence_parallel=2)
    box = M.Budget(256 << 20, 64 * GIB)
    at_2 = X.max_context(cfg.model, cfg.data, split, cfg.zero, box, 2)
    at_1 = X.max_context(cfg.model, cfg.data, cfg.train, cfg.zero, box, 2)
    assert X.to_json(at_2)["sequence_parallel"] == 2
    better = 0
    for a, b in zip(at_2.answers, at_1.answers, strict=True):
        if a.longest is None:
            continue
        seq = a.longest.seq_len
        m, d = (dataclasses.replace(s, seq_len=seq + X.STEP) for s in (cfg.model, cfg.data))
        more = M.estimate_to_fit(m, d, split, cfg.zero, 2, 1, "cuda", box).get(a.policy)
        assert a.longest.pe.fits(box) and not more.fits(box) and a.next.seq_len == seq + X.STEP
        better += b.longest is None or seq > b.longest.seq_len
    assert better >= 6


def test_suggest_and_auto_take_the_smallest_n_that_fits_one_sequence(monkeypatch) -> None:
    """gpt-7b at 1.25M tokens on 8 x 80 GiB: no policy fits at N = 1 nor at N = 2; at N = 4 one does, and both
    --suggest and `zero: auto` say so; auto writes N into the run's config and keeps its global batch."""
    from zoff.planning import estimate as E

    cfg = _gpt7b(5 << 18, "zero=auto")
    with pytest.raises(UserError, match="zero: auto: no policy fits"):
        C.resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, 8, BOX.gpu, BOX.cpu, split=False)
    at_2 = M.estimate_to_fit(
        cfg.model, cfg.data, dataclasses.replace(cfg.train, sequence_parallel=2), cfg.zero, 8, 1, "cuda", BOX
    )
    assert C.suggest_policy(at_2, BOX)[0] is None
    got = C.resolve_auto(cfg.model, cfg.data, cfg.train, cfg.zero, 8, BOX.gpu, BOX.cpu)
    assert got[6] == 4 and got[4].startswith("train.sequence_parallel: 4, ") and "\n" not in got[4]
    at_4 = dataclasses.replace(cfg.train, sequence_parallel=4, grad_accum=4 * cfg.train.grad_accum)
    row = M.estimate_to_fit(cfg.model, cfg.data, at_4, cfg.zero, 8, 1, "cuda", BOX).get(Policy(*got[:4]))
    assert row.fits(BOX)
    monkeypatch.setattr(E, "detect_budget", lambda gpu, cpu: (BOX, "cuda"))
    chosen, why = E.choose_policy(cfg)
    assert chosen.train.sequence_parallel == 4 and "train.sequence_parallel: 4, " in why
    # the global batch (sequences a step): 1 x 4 micro-batches x 8 ranks before, 1 x 16 x 8 / 4 now
    assert chosen.train.grad_accum == 16 and not chosen.zero.auto


# ------------------------------------------------------------------------------------ the docs' table


def _context_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("context_table", REPO / "scripts" / "context_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_estimates_page_embeds_the_context_table_rendered_from_its_json() -> None:
    """docs/memory-estimates.md's long-context table is scripts/context_table.py's render of its JSON: a changed
    number there makes the page differ. Its figures are the estimate's at N (each box's sequence_parallel),
    with learned and with rotary positions."""
    import copy
    import json

    ct = _context_table()
    data = json.loads(ct.JSON.read_text())
    assert data["date"] and data["commit"] and data["machine"]
    for positions in ("learned", "rotary"):
        assert [b[positions]["sequence_parallel"] for b in data["boxes"]] == [1, 1, 8, 32]
        assert [b[positions]["target"] is not None for b in data["boxes"]] == [False, False, True, True]
    page = (REPO / "docs" / "memory-estimates.md").read_text()
    assert ct.render(data) in page
    for positions in ("learned", "rotary"):
        changed = copy.deepcopy(data)
        row = next(
            p
            for p in changed["boxes"][2][positions]["policies"]
            if p["name"] == "zero3-offload" and p["activation_checkpointing"]
        )
        row["longest"]["seq_len"] += 1 << 20
        assert ct.render(changed) not in page


@pytest.mark.grid  # (about 3 min: eight --max-context searches to 32M tokens, and the targets)
def test_the_context_table_is_what_the_estimate_computes_now() -> None:
    import json

    ct = _context_table()
    want, got = json.loads(ct.JSON.read_text()), ct.compute()
    for positions in ct.POSITIONS:
        assert [b[positions] for b in got["boxes"]] == [b[positions] for b in want["boxes"]]


def test_rotary_positions_reach_the_issues_targets_and_learned_ones_do_not() -> None:
    """Issue 55's targets by the estimate: 4M tokens on 8 x 80 GiB and 16M on 32 x 80 GiB, each sequence split
    over the GPUs. With the builtin GPT's learned table (seq x d_model, gathered whole with the embeddings, and
    its gradient) they are out of reach; with rotary positions (no table) they fit, at the table's JSON and
    recomputed here at the targets."""
    import json

    ct = _context_table()
    boxes = [b for b in json.loads(ct.JSON.read_text())["boxes"] if b["learned"]["target"]]
    assert [b["rotary"]["target"]["seq_len"] for b in boxes] == [4 << 20, 16 << 20]
    for box in boxes:
        learned, rotary = box["learned"]["target"], box["rotary"]["target"]
        assert rotary["fits"] and not learned["fits"] and rotary["position_table_bytes"] == 0
    for seq, gpus, nodes, n in ((4 << 20, 8, 1, 8), (16 << 20, 8, 4, 32)):
        cfg = _gpt7b(
            seq,
            "train.activation_checkpointing=true",
            f"train.sequence_parallel={n}",
            "model.positions=rotary",
        )
        row = M.estimate_to_fit(cfg.model, cfg.data, cfg.train, cfg.zero, gpus, nodes, "cuda", BOX)
        assert row.get(Policy(3, "cpu", "cpu", True)).fits(BOX)
