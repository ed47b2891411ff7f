"""Exact speculation (zero.offload_optimizer.speculate, engine/step/speculate.py): the update computed beside the
last backward and committed only where it is the step. Speculation on equals speculation off, bit for bit
(parameters, optimizer states, losses, gradient norms), whether the clip never triggers, always triggers or
alternates, under fp16 overflow, accumulation, stages 1-3 on the host and disk tiers with and without the
overlapped step, a late gradient correction, a checkpoint taken and resumed; a failing worker names itself
and applies nothing. Each case also checks that speculation really ran and committed (or discarded) what it
should, so that a broken speculation that never commits cannot pass as "equal"."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.harness import spawn
from tests.patterns import models
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

NEVER, ALWAYS = 100.0, 0.05  # clip thresholds: far above every step's norm, and below every one
ALTERNATE = 1.9  # between the norms of this model's steps (asserted: the run both clips and does not)


def _engine(
    spec, swap: Path, stage: int = 3, opt: str = "nvme", par: str = "nvme", precision: str = "bf16",
    clip: float = NEVER, accum: int = 1, overlap: bool = False, model=None,
):  # fmt: skip
    torch.manual_seed(0)
    zero = ZeroConfig(
        stage=stage, reduce_bucket_size=1500, param_persistence_threshold=64,
        offload_optimizer=OffloadOptimizerConfig(
            device=opt, nvme_path=str(swap) if opt == "nvme" else None, io=OptimizerIoConfig(threads=2, request_mb=1),
            # (disk: every state streamed; host: the budget leaves room for every unit's second buffers)
            host_budget="min" if opt == "nvme" else "1GiB", overlap_step=overlap, speculate=spec,
        ),
        offload_param=OffloadParamConfig(device=par if stage == 3 else "none", io=IoConfig(threads=2, request_mb=1)),
    )  # fmt: skip
    model = model if model is not None else GPT(4, 2, 32, 64, 16)
    return build_engine(
        model,
        zero,
        OptimConfig(lr=1e-2, weight_decay=0.1),
        precision=precision,
        grad_clip=clip,
        grad_accum=accum,
    )


def _train(eng, steps: int = 4, accum: int = 1, blow_up: int | None = None, seed: int = 1) -> dict:
    """`steps` steps on fixed batches; `blow_up`: the step whose loss is multiplied by inf (fp16 overflow)."""
    gen = torch.Generator().manual_seed(seed)
    losses, norms, commits = [], [], []
    for step in range(steps):
        eng.zero_grad()
        for micro in range(accum):
            x = torch.randint(0, 64, (2, 16), generator=gen)
            loss = eng.model(x).float().logsumexp(-1).mean() / accum
            if step == blow_up:
                loss = loss * float("inf")
            eng.backward(loss, sync=micro == accum - 1, lr=1e-2)
        result = eng.step(1e-2)
        losses.append(loss.item())
        norms.append(result.grad_norm)
        commits.append(dict(eng.speculation.last) if eng.speculation is not None else None)
    return {"losses": losses, "norms": norms, "commits": commits}


def _states(eng) -> dict:
    out = {f"p.{k}": v for k, v in eng.gathered_params().items()}
    for u in range(len(eng.plan.units)):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            out[f"u{u}.{kind}"] = eng.optimizer.read(u, kind).clone()
    return out


def _pair(
    swap: Path, steps: int = 4, accum: int = 1, blow_up: int | None = None, prepare=None, **kw
) -> tuple[dict, dict]:
    """The same run with speculation off and forced on (`prepare` applied to that engine); asserts every bit
    equal; returns both runs."""
    runs = []
    for spec in (False, True):
        eng = _engine(spec, swap / str(spec), accum=accum, **kw)
        if spec and prepare is not None:
            prepare(eng)
        run = _train(eng, steps, accum, blow_up)
        run["states"] = _states(eng)
        eng.close()
        runs.append(run)
    off, on = runs
    assert on["losses"] == off["losses"] or _same_nan(on["losses"], off["losses"])
    assert on["norms"] == off["norms"] or _same_nan(on["norms"], off["norms"])
    for name, t in off["states"].items():
        assert torch.equal(on["states"][name], t), name
    return off, on


def _same_nan(a: list[float], b: list[float]) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


def _committed(run: dict) -> list[int]:
    return [c["committed"] for c in run["commits"]]


def _speculated(run: dict) -> list[int]:
    return [c["speculated"] for c in run["commits"]]


# stage, optimizer tier, parameter tier, precision, overlap_step, accumulation
CELLS = [
    (3, "nvme", "nvme", "bf16", False, 1),
    (3, "nvme", "nvme", "bf16", True, 3),
    (3, "nvme", "none", "fp32", True, 1),
    (2, "nvme", "none", "bf16", False, 3),
    (1, "nvme", "none", "fp32", False, 1),
    (3, "cpu", "cpu", "bf16", True, 1),
    (3, "cpu", "none", "fp32", False, 3),
    (2, "cpu", "none", "bf16", False, 1),
    (1, "cpu", "none", "fp16", False, 3),
]


@pytest.mark.parametrize(("stage", "opt", "par", "precision", "overlap", "accum"), CELLS)
def test_speculation_is_the_step_bit_for_bit_when_the_clip_never_triggers(
    stage: int, opt: str, par: str, precision: str, overlap: bool, accum: int, swap: Path
) -> None:
    _, on = _pair(
        swap, stage=stage, opt=opt, par=par, precision=precision, overlap=overlap, accum=accum, clip=NEVER
    )
    assert sum(_committed(on)) > 0  # speculation really committed updates
    assert _committed(on) == _speculated(on)  # and every one it finished (nothing clipped)


@pytest.mark.parametrize(("opt", "par"), [("nvme", "nvme"), ("cpu", "none")])
def test_a_clip_on_every_step_discards_every_speculation(opt: str, par: str, swap: Path) -> None:
    _, on = _pair(swap, opt=opt, par=par, clip=ALWAYS)
    assert sum(_speculated(on)) > 0 and sum(_committed(on)) == 0


def test_a_clip_on_some_steps_commits_the_others(swap: Path) -> None:
    off, on = _pair(swap, steps=6, clip=ALTERNATE, overlap=True)
    clipped = [n > ALTERNATE for n in off["norms"]]
    assert any(clipped) and not all(clipped)  # the regime this test is about
    for c, was_clipped in zip(on["commits"], clipped, strict=True):
        assert (c["committed"] == 0) if was_clipped else (c["committed"] == c["speculated"]), (c, was_clipped)


def test_an_fp16_overflow_discards_the_speculation_and_skips_the_step(swap: Path) -> None:
    off, on = _pair(swap, steps=4, precision="fp16", blow_up=1, opt="cpu", par="none", stage=2,
                    prepare=_worker_drained_before_the_step)  # fmt: skip
    assert off["norms"][1] == float("inf")  # the step was skipped
    assert _committed(on)[1] == 0 and _speculated(on)[1] > 0
    assert _committed(on)[2] > 0 or _committed(on)[3] > 0


def test_a_late_gradient_correction_taints_its_unit(swap: Path) -> None:
    cfg = SimpleNamespace(vocab_size=64, d_model=32, n_layer=2)
    runs = []
    for spec in (False, True):
        torch.manual_seed(0)
        eng = _engine(spec, swap / str(spec), model=models.ckpt_shared_reentrant(cfg), stage=2, par="none")
        run = _train(eng, steps=3)
        run["states"], run["corrections"] = _states(eng), eng.reducer.corrections
        run["tainted"] = eng.speculation.counts["tainted_units"] if eng.speculation is not None else 0
        eng.close()
        runs.append(run)
    off, on = runs
    assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
    assert all(torch.equal(on["states"][k], v) for k, v in off["states"].items())
    assert on["corrections"] > 0 and on["tainted"]  # a unit's gradient changed after it was final


def _broken_on_step(eng, step: int) -> None:
    """From the engine's `step`-th speculation on, its worker's unit update raises (a disk gone away)."""
    unit, seen = eng.optimizer.speculate_unit, [0]
    begin = eng.speculation.begin

    def counting_begin(*args, **kwargs):
        seen[0] += 1
        return begin(*args, **kwargs)

    def broken(*args, **kwargs):
        if seen[0] >= step:
            raise OSError("the disk went away")
        return unit(*args, **kwargs)

    eng.speculation.begin, eng.optimizer.speculate_unit = counting_begin, broken


def test_a_failing_worker_turns_speculation_off_and_the_step_walks_the_same_bits(swap: Path, capsys) -> None:
    """A worker error discards that step's speculation and turns speculation off for the run, in one line
    naming the error; the step walks as without it: no raise (its peers would wait in the norm's all-reduce),
    the same bits as a run that never speculated."""
    off, on = _pair(swap, steps=4, clip=NEVER, prepare=lambda eng: _broken_on_step(eng, 2))
    lines = [x for x in capsys.readouterr().out.splitlines() if "speculation" in x]
    assert len(lines) == 1, lines
    assert "off for the rest of this run" in lines[0] and "OSError: the disk went away" in lines[0]
    assert on["commits"][0]["committed"] > 0  # the first step speculated and committed
    assert on["commits"][1:] == [None, None, None]  # off from the failing step (the second) on


def test_auto_speculates_only_after_a_step_that_did_not_clip(swap: Path) -> None:
    for clip, want in ((NEVER, [False, True, True]), (ALWAYS, [False, False, False])):
        eng = _engine("auto", swap / str(clip), clip=clip)
        ran = []
        for _ in range(3):
            n = eng.speculation.counts["steps"]  # (counted once per speculated step, committed or not)
            _train(eng, steps=1)
            ran.append(eng.speculation.counts["steps"] > n)
        eng.close()
        assert ran == want, (clip, ran)


def _sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_a_checkpoint_holds_no_speculative_bytes_and_resumes_the_same_run(swap: Path) -> None:
    from zoff.checkpoint import load_checkpoint, save_checkpoint

    shards, cont, saved = [], [], None
    for spec in (False, True):
        eng = _engine(spec, swap / f"run{spec}", clip=NEVER)
        _train(eng, steps=3)
        if spec:  # some pieces live in their second slot now: the save must bring them home
            assert any(eng.optimizer.states.where)
        ckpt = save_checkpoint(eng, swap / f"ckpt{spec}", 3, {"step": 3}, "{}")
        shards.append(_sha(ckpt / "shard_00000.safetensors"))
        saved = ckpt
        cont.append(_train(eng, steps=2, seed=7)["losses"])
        eng.close()
    assert shards[0] == shards[1]  # byte for byte the checkpoint of the run without speculation
    assert cont[0] == cont[1]
    resumed = _engine(True, swap / "resumed", clip=NEVER)
    load_checkpoint(resumed, saved)
    assert _train(resumed, steps=2, seed=7)["losses"] == cont[0]
    resumed.close()


def test_the_config_refuses_speculate_true_where_it_cannot_run() -> None:
    base = {"model": {"name": "gpt", "n_layer": 1, "n_head": 1, "d_model": 8, "vocab_size": 256, "seq_len": 8},
            "data": {"name": "synthetic", "seq_len": 8}}  # fmt: skip
    for oo, why in (
        ({"device": "none"}, "device cpu or nvme"),
        ({"device": "cpu", "delay_update": True}, "DPU"),
    ):
        with pytest.raises(ConfigError, match=rf"zero.offload_optimizer.speculate: true .*{why}"):
            config_from_dict(base | {"zero": {"stage": 2, "offload_optimizer": oo | {"speculate": True}}})
    with pytest.raises(
        ConfigError, match="zero.offload_optimizer.speculate: expected one of auto, True, False"
    ):
        config_from_dict(
            base | {"zero": {"stage": 2, "offload_optimizer": {"device": "cpu", "speculate": "yes"}}}
        )


def test_a_window_that_never_steps_discards_its_speculation(swap: Path) -> None:
    """A last backward whose step never comes (zero_grad, or another backward, first): its worker is stopped
    and nothing of it is committed; the run goes on as one that never speculated."""
    runs = []
    for spec in (False, True):
        eng = _engine(spec, swap / str(spec))
        _train(eng, steps=1)
        eng.zero_grad()
        loss = eng.model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean()
        eng.backward(loss, lr=1e-2)  # speculates; no step follows
        if spec:
            assert eng.speculation.active
        run = _train(eng, steps=2, seed=3)  # (zero_grad first: the speculation is discarded)
        run["states"] = _states(eng)
        eng.close()
        runs.append(run)
    off, on = runs
    assert on["losses"] == off["losses"] and _committed(on) == [c["speculated"] for c in on["commits"]]
    assert all(torch.equal(on["states"][k], v) for k, v in off["states"].items())


def _worker_drained_before_the_step(eng) -> None:
    """The step stops the worker only once it has taken every landed unit (so it completed all but the last):
    on a loaded host it may otherwise complete none before backward ends. Those units would go to the walk,
    which is correct, but a test that speculation is discarded needs some speculated."""
    spec = eng.speculation
    stop = spec.stop

    def stop_when_drained(*args, **kwargs):
        deadline = time.monotonic() + 60
        # (a worker that failed is gone, its queue never empties: no wait for it)
        while (
            spec.active and spec.thread.is_alive() and not spec.queue.empty() and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        return stop(*args, **kwargs)

    spec.stop = stop_when_drained


def _slowed(unit):
    def slow(*args, **kwargs):
        time.sleep(0.02)
        return unit(*args, **kwargs)

    return slow


def _ranked(rank: int, world: int, swap: str, stage: int, opt: str, par: str) -> dict:
    """One rank of a 2-rank run, speculation off then on; rank 1's worker is slowed down, so that the ranks
    complete different units before the step: a unit commits only where every rank completed it."""
    out = {}
    for spec in (False, True):
        eng = _engine(spec, Path(swap) / str(spec), stage=stage, opt=opt, par=par)
        if spec and rank == 1:
            eng.optimizer.speculate_unit = _slowed(eng.optimizer.speculate_unit)
        run = _train(eng, steps=4, seed=1 + rank)  # (each rank its own batches)
        run["params"] = eng.gathered_params()
        eng.close()
        out[spec] = run
    return out


@pytest.mark.parametrize(("stage", "opt", "par"), [(2, "cpu", "none"), (3, "nvme", "nvme")])
def test_two_ranks_commit_only_what_both_completed_and_stay_bit_for_bit(
    stage: int, opt: str, par: str, swap: Path
) -> None:
    """The all-gathers after a step follow the committed set, so both ranks must commit the same units: a
    unit one rank's worker did not reach goes to the walk on both."""
    for rank_result in spawn(_ranked, 2, str(swap), stage, opt, par):
        off, on = rank_result[False], rank_result[True]
        assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
        assert all(torch.equal(on["params"][k], v) for k, v in off["params"].items())
        assert sum(_committed(on)) > 0


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_planted_at_the_second_slots_file_leaves_its_target_alone(kind: str, swap: Path) -> None:
    """The second slots' file is made mid-run, at the first speculated step, on a possibly shared scratch disk:
    a link planted at its name loses the name and its target keeps its bytes, as for every swap file."""
    victim = swap / "victim.bin"
    victim.write_bytes(b"someone else's data\n" * 1000)
    folder = swap / "run" / "rank0"
    folder.mkdir(parents=True)
    target = folder / "optimizer.spec.swap"
    target.symlink_to(victim) if kind == "symlink" else os.link(victim, target)
    eng = _engine(True, swap / "run")
    _train(eng, steps=2)
    spec_file = eng.optimizer.states.spec_file
    assert spec_file is not None and not spec_file.path.is_symlink()
    assert eng.speculation.counts["committed_units"] > 0  # (the second slots were really written and used)
    eng.close()
    assert victim.read_bytes() == b"someone else's data\n" * 1000 and victim.stat().st_nlink == 1


def _one_rank_fails(rank: int, world: int, swap: str) -> dict:
    """Speculation off, then forced on with rank 1's worker failing from the second step on."""
    out = {}
    for spec in (False, True):
        eng = _engine(spec, Path(swap) / f"{spec}{rank}", stage=2, opt="cpu", par="none")
        if spec:
            _worker_drained_before_the_step(eng)  # (so that the first step surely commits something)
        if spec and rank == 1:
            _broken_on_step(eng, 2)
        run = _train(eng, steps=4, seed=1 + rank)
        run["params"], run["off_after"] = (
            eng.gathered_params(),
            eng.speculation is None and not eng.speculates,
        )
        eng.close()
        out[spec] = run
    return out


def test_a_worker_failing_on_one_rank_turns_speculation_off_on_every_rank(swap: Path) -> None:
    """The failing rank's peers hear of it in the norm's all-reduce (no wait until the timeout): every rank
    discards that step's speculation, turns it off, and the step walks: the same bits as never speculating."""
    for rank_result in spawn(_one_rank_fails, 2, str(swap)):
        off, on = rank_result[False], rank_result[True]
        assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
        assert all(torch.equal(on["params"][k], v) for k, v in off["params"].items())
        assert on["commits"][0]["committed"] > 0 and on["commits"][1:] == [None, None, None]
        assert on["off_after"]
