"""`zoff estimate --max-model`: per policy, the largest rung of a GPT ladder that fits, checked against estimate()."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from tests.forked_zoff import zoff_run
from zoff import cli
from zoff.config import load_config
from zoff.engine.policy import Policy
from zoff.planning import capacity as C
from zoff.planning import estimate as E
from zoff.planning import memory as M

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "configs" / "gpt-7b.yaml"
GIB, TB = 2**30, 10**12
BOX = M.Budget(24 * GIB, 128 * GIB, disk=4 * TB)  # one 24 GiB GPU, 128 GiB of RAM, a 4 TB disk


@pytest.fixture(scope="module")
def ladder() -> dict[str, M.Estimate]:
    """estimate() called directly for every rung of the ladder: 1 GPU, the base config's data and train."""
    cfg = load_config(BASE)
    return {
        r.label: M.estimate(C.rung_model(cfg.model, r), cfg.data, cfg.train, cfg.zero, 1, 1, "cuda", BOX.cpu)
        for r in C.LADDER
    }


@pytest.fixture(scope="module")
def memo() -> dict:
    """Estimates of the stage-3 fallbacks (memory.fit_gathering), shared by the walks: they do not depend on
    the GPU or disk budget."""
    return {}


def _max_model(budget: M.Budget, ladder: dict[str, M.Estimate], memo: dict | None = None) -> C.Capacity:
    cfg = load_config(BASE)
    # the memo holds the test's own estimates: only the walk and fits() are under test here (max_model adds
    # the estimates of its stage-3 fallbacks, keyed by the changes)
    memo = {} if memo is None else memo
    memo.update(
        {(label, budget.cpu): est for label, est in ladder.items()}
    )  # (every budget here has BOX's RAM)
    return C.max_model(cfg.model, cfg.data, cfg.train, cfg.zero, budget, 1, memo=memo)


def _fitted(label: str, ladder: dict[str, M.Estimate], memo: dict, budget: M.Budget) -> M.Estimate:
    """The rung's estimate with memory.fit_gathering's choices, from estimate() here where memo lacks one."""
    cfg = load_config(BASE)
    model = C.rung_model(cfg.model, next(r for r in C.LADDER if r.label == label))

    def at(z):
        key = (label, budget.cpu, *z.block_classes, z.overlap_comm)
        if key not in memo:
            memo[key] = M.estimate(model, cfg.data, cfg.train, z, 1, 1, "cuda", budget.cpu)
        return memo[key]

    return M.fit_gathering(ladder[label], budget, model, cfg.zero, at, M.mlp_tiles(cfg.train, cfg.data))


def _index(a: C.Answer) -> int:
    return -1 if a.largest is None else C.LADDER.index(a.largest.rung)


def test_answer_fits_and_every_larger_rung_does_not(ladder, memo) -> None:
    cap = _max_model(BOX, ladder, memo)
    fitted = lambda label: _fitted(label, ladder, memo, BOX)  # noqa: E731
    assert len(cap.answers) == len(M.POLICIES) and {a.policy for a in cap.answers} == set(M.POLICIES)
    for a in cap.answers:
        i = _index(a)
        if i >= 0:
            pe = fitted(C.LADDER[i].label).get(a.policy)
            assert (
                pe.fits(BOX) and a.largest.pe == pe and a.largest.params == ladder[C.LADDER[i].label].params
            )
        for r in C.LADDER[i + 1 :]:
            assert not fitted(r.label).get(a.policy).fits(BOX), (a.policy, r.label)
        if i + 1 < len(C.LADDER):
            assert a.next.rung == C.LADDER[i + 1] and C.limited_by(a.next.pe, BOX)
        else:
            assert a.next is None
    # this box is far from both ends of the ladder: some policy fits 6.7B, none fits 405B
    assert max(map(_index, cap.answers)) >= C.LADDER.index(next(r for r in C.LADDER if r.label == "6.7B"))
    assert all(a.next is not None for a in cap.answers)


def test_more_gpu_memory_never_gives_a_smaller_answer(ladder, memo) -> None:
    previous = None
    for gib in (4, 8, 16, 24, 40, 48, 80, 141, 1024):
        cap = _max_model(dataclasses.replace(BOX, gpu=gib * GIB), ladder, memo)
        now = {a.policy: _index(a) for a in cap.answers}
        if previous is not None:
            assert all(now[p] >= previous[p] for p in now), gib
        previous = now


def test_nvme_policies_need_room_for_their_swap_files(ladder, memo) -> None:
    no_disk = _max_model(dataclasses.replace(BOX, disk=0), ladder, memo)
    for a in no_disk.answers:
        if a.policy.offload_optimizer == "nvme":
            assert a.largest is None and "disk" in C.limited_by(a.next.pe, no_disk.budget)
    pol = Policy(3, "nvme", "nvme", True)
    best = _max_model(BOX, ladder, memo).answers[C.row_order().index(pol)].largest
    # the swap files (speculation's second slots, a part of disk, take only what room the disk has left)
    need = (best.pe.disk - best.pe.speculation.second.disk_bytes) * best.pe.local_ranks
    just = _max_model(dataclasses.replace(BOX, disk=need), ladder, memo).answers[C.row_order().index(pol)]
    short = _max_model(dataclasses.replace(BOX, disk=need - 1), ladder, memo).answers[
        C.row_order().index(pol)
    ]
    assert just.largest.rung == best.rung
    assert _index(short) < C.LADDER.index(best.rung) and short.next.rung == best.rung


def test_table_top_of_the_ladder_and_says_estimates(capsys) -> None:
    # enough of everything: every policy fits the largest rung (one estimate: the walk stops there)
    E.run_cli(BASE, [], "8", None, "1PiB", "1PiB", False, False, max_model=True, disk="1PiB")
    out = capsys.readouterr().out
    assert "estimates, not GPU runs" in out
    for p in C.row_order():
        assert C.row_label(p) + " " in out
    assert out.count("405B (126 x 16384)") == len(M.POLICIES) and "ladder top" in out


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--disk", "lots"], "--disk"),
        (["--disk", "-1TB"], "--disk"),
        (["--disk", "2PiB"], "--disk"),
        (["--gpu-memory", "12KB"], "--gpu-memory"),
        (["--gpu-memory", "24 gigs"], "--gpu-memory"),
        (["--suggest"], "--max-model"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], flag: str, monkeypatch, capsys) -> None:
    """zoff.cli.main in-process (the flags fail before any estimate): one stderr line naming the flag, exit 2."""
    monkeypatch.setattr(sys, "argv", ["zoff", "estimate", str(BASE), "--max-model", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr()
    assert e.value.code == 2 and not err.out
    assert len(err.err.splitlines()) == 1 and err.err.startswith(f"zoff: error: {flag}: "), err.err
    assert "Traceback" not in err.err


def test_json_through_the_real_cli(ladder, memo) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    flags = ["--gpus-per-node", "1", "--gpu-memory", "24GiB", "--cpu-memory", "128GiB", "--disk", "4TB"]
    # (a new interpreter for this one; the other CLI calls of the module are forked: tests.forked_zoff)
    p = zoff_run(
        ["estimate", str(BASE), "--max-model", "--json", *flags], cwd=REPO, env=env, timeout=120, fresh=True
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert "estimates, not GPU runs" in out["note"] and out["memory"]["disk_bytes"] == 4 * TB
    expected = {C.row_label(a.policy): a for a in _max_model(BOX, ladder, memo).answers}
    assert [row["label"] for row in out["policies"]] == list(expected)
    for row in out["policies"]:
        a = expected[row["label"]]
        assert (row["largest"] or {}).get("model") == (a.largest.rung.label if a.largest else None)
        if a.largest:
            assert row["largest"]["params"] == a.largest.params
            assert row["largest"]["gpu_bytes"] == a.largest.pe.gpu_bytes <= BOX.gpu


# The long-sequence switches a long context or a giant layer runs with (the capacity table's context column).
LONG = ["data.batch_size=1", "train.loss_tile=4096", "train.mlp_tile=4096", "train.activation_offload=true"]


@pytest.mark.parametrize(
    "what, overrides, box, policy, changes",
    [
        ("gpt-7b at context 131072", ["model.seq_len=131072", "data.seq_len=131072"],
         M.Budget(24 * GIB, 256 * GIB), Policy(3, "cpu", "cpu", True), {}),
        ("175B at context 4096", ["model.n_layer=96", "model.d_model=12288", "model.n_head=96"],
         M.Budget(24 * GIB, 128 * GIB, disk=4 * TB), Policy(3, "nvme", "nvme", True), {}),
        ("405B at context 4096", ["model.n_layer=126", "model.d_model=16384", "model.n_head=128"],
         M.Budget(24 * GIB, 256 * GIB, disk=8 * TB), Policy(3, "nvme", "nvme", True),
         {"block_classes": ("Linear",), "overlap_comm": False}),
    ],
)  # fmt: skip
def test_long_contexts_and_giant_layers_fit_one_24_gib_gpu(what, overrides, box, policy, changes) -> None:
    """By estimate (its terms held equal to the engine's allocations by the other tests): the 405B fits only
    with each Linear gathered alone and one reduction in flight, which the estimate chooses by itself
    (memory.fit_gathering), and `zoff estimate` says so; whole layers do not fit."""
    cfg = load_config(BASE, [*LONG, *overrides])
    at = lambda z: M.estimate(cfg.model, cfg.data, cfg.train, z, 1, 1, "cuda", box.cpu)  # noqa: E731
    plain = at(cfg.zero).get(policy)
    pe = M.fit_gathering(at(cfg.zero), box, cfg.model, cfg.zero, at, M.mlp_tiles(cfg.train, cfg.data)).get(
        policy
    )
    assert pe.fits(box) and dict(pe.zero_changes) == changes, (what, pe.gpu_bytes / GIB)
    assert plain.fits(box) == (not changes)
    if changes:  # the same choice through the real CLI, in its JSON
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        args = [
            "--gpus-per-node",
            "1",
            "--gpu-memory",
            "24GiB",
            "--cpu-memory",
            "256GiB",
            "--disk",
            "8TB",
            "--json",
        ]
        p = zoff_run(["estimate", str(BASE), *LONG, *overrides, *args], cwd=REPO, env=env)
        assert p.returncode == 0, p.stderr
        row = next(
            r
            for r in json.loads(p.stdout)["policies"]
            if r["name"] == policy.name and r["activation_checkpointing"]
        )
        assert row["fits"] and row["zero_changes"] == {"block_classes": ["Linear"], "overlap_comm": False}
        assert row["gpu_bytes"] == pe.gpu_bytes


# ------------------------------------------------------------------------------------------- --max-context
def test_max_context_is_the_longest_length_that_fits_by_estimate() -> None:
    """Per policy: the answer fits by estimate() called directly at that length, STEP tokens more do not, and
    the answer is a multiple of STEP; checkpointing never shortens it."""
    from zoff.planning import context as X

    cfg = load_config(BASE, ["data.batch_size=1", "train.loss_tile=4096"])
    box = M.Budget(24 * GIB, 256 * GIB, disk=0)
    ctx = X.max_context(cfg.model, cfg.data, cfg.train, cfg.zero, box, 1)
    by_policy = {a.policy: a for a in ctx.answers}
    assert [a.policy for a in ctx.answers] == C.row_order()
    direct: dict[int, M.Estimate] = {}  # estimate() by length, called here, apart from the module's own memo

    def fits(policy: Policy, length: int) -> bool:
        if length not in direct:
            m, d = (
                dataclasses.replace(cfg.model, seq_len=length),
                dataclasses.replace(cfg.data, seq_len=length),
            )
            direct[length] = M.estimate_to_fit(m, d, cfg.train, cfg.zero, 1, 1, "cuda", box)
        return direct[length].get(policy).fits(box)

    answered = 0
    for a in ctx.answers:
        if a.longest is None:
            assert not fits(a.policy, X.STEP) and a.next.seq_len == X.STEP
            continue
        answered += 1
        seq = a.longest.seq_len
        assert seq % X.STEP == 0 and a.next.seq_len == seq + X.STEP
        assert fits(a.policy, seq) and not fits(a.policy, seq + X.STEP), a.policy
        if not a.policy.activation_checkpointing:
            twin = by_policy[dataclasses.replace(a.policy, activation_checkpointing=True)]
            assert twin.longest.seq_len >= seq
    assert answered >= 6  # the offload policies on this box


def test_max_context_through_the_real_cli() -> None:
    """The tiny config on a 64 MiB "GPU": the table, its JSON (the same answers), and --suggest refused."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = ["estimate", str(REPO / "configs" / "tiny.yaml"), "--max-context", "--gpus-per-node", "1",
            "--gpu-memory", "64MiB", "--cpu-memory", "8GiB", "--disk", "0"]  # fmt: skip
    run = lambda *extra: zoff_run([*args, *extra], cwd=REPO, env=env, timeout=180)  # noqa: E731
    table, as_json = run(), run("--json")
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    out = table.stdout
    assert "Longest context each policy trains (estimated)" in out and "estimates, not GPU runs" in out
    rows = json.loads(as_json.stdout)["policies"]
    assert [r["label"] for r in rows] == [C.row_label(p) for p in C.row_order()]
    longest = [r["longest"]["seq_len"] for r in rows if r["longest"]]
    assert longest and all(f"{n // 1024}K" in out for n in longest)
    bad = run("--suggest")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "zoff: error: --max-context: cannot be combined with --suggest (each table names every policy's answer)"
    ), bad.stderr
