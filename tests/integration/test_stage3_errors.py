"""What stage 3 cannot support fails loudly, naming the parameter or block, instead of crashing or mixing weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import rank_device, spawn, tiny_cfg
from zoff.config import config_from_dict
from zoff.engine.comm.collectives import Comm
from zoff.engine.comm.gather_checks import GatherChecks
from zoff.trainer.loop import train_loop
from zoff.trainer.session import build_session

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


class ReadsBlockWeightOutside(nn.Module):
    """The root reads a block's weight outside that block's forward (the block's unit is released there)."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        h = F.linear(h, self.blocks[0].weight)  # outside blocks.0's forward
        return self.head(h)


class RankDependentBlocks(nn.Module):
    """Three blocks run in the order `rank0` names on rank 0 and 0, 1, 2 elsewhere. [0, 1, 1]: rank 0 runs
    block 1 twice and never block 2 (same number of gathers, wrong pairs); [0, 1]: rank 0's forward ends
    without block 2."""

    def __init__(self, vocab: int, d: int, rank0: tuple[int, ...]):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, vocab)
        self.rank0 = rank0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for i in self.rank0 if os.environ.get("RANK") == "0" else (0, 1, 2):
            h = h + torch.tanh(self.blocks[i](h))
        return self.head(h)


def skips_last(cfg) -> nn.Module:
    return RankDependentBlocks(int(cfg.vocab_size), int(cfg.d_model), (0, 1))


def reads_outside(cfg) -> nn.Module:
    return ReadsBlockWeightOutside(int(cfg.vocab_size), int(cfg.d_model))


def rank_dependent(cfg) -> nn.Module:
    return RankDependentBlocks(int(cfg.vocab_size), int(cfg.d_model), (0, 1, 1))


def _train(rank: int, world: int, cfg_dict: dict, side_checks: bool = False) -> str:
    """Train; the error's message if it fails. `side_checks`: the same-gathers check as NCCL runs it (over a
    gloo group beside the data group, names checked before the gather is issued)."""
    if side_checks:
        import zoff.trainer.session as session

        session.Comm = partial(Comm, side_checks=True)  # this rank's process only
    cfg = config_from_dict(cfg_dict)
    s = build_session(cfg, rank_device(rank))  # a GPU per rank under ZOFF_TEST_DEVICE=cuda (tests/gpu)
    try:
        train_loop(s)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "trained"


def _cfg(factory: str, stage: int) -> dict:
    return tiny_cfg(
        model={
            "name": f"python:tests.integration.test_stage3_errors:{factory}",
            "d_model": 32,
            "vocab_size": 256,
        },
        zero={"stage": stage, "param_persistence_threshold": 0},
        train={"max_steps": 2, "grad_accum": 1},
    )


def test_reading_a_released_parameter_names_it_and_the_reader() -> None:
    stage3 = spawn(_train, 2, _cfg("reads_outside", 3))
    for message in stage3:
        assert message.startswith(
            "UnsupportedModelError: zero.stage 3: parameter 'blocks.0.weight' was read by "
            "module 'ReadsBlockWeightOutside (the model)' outside the forward of 'blocks.0'"
        ), message
    assert spawn(_train, 2, _cfg("reads_outside", 2)) == ["trained", "trained"]  # stage 2 keeps params whole


@pytest.mark.parametrize("side_checks", [False, True], ids=["gloo", "side-group"])
def test_blocks_run_on_some_ranks_only_are_refused(side_checks: bool) -> None:
    """Rank 0 gathers blocks.1 again where rank 1 gathers blocks.2: both name the two blocks and the fix.
    side-group: the check as it runs beside NCCL (a gloo group of its own, checked before the gather)."""
    r0, r1 = spawn(_train, 2, _cfg("rank_dependent", 3), side_checks)
    assert r0.startswith(
        "SkippedBlockError: zero.stage 3: rank 0 gathered block 'blocks.1' while rank 1 gathered block "
        "'blocks.2' in this forward: the ranks ran different blocks, or the same ones in another order; "
        "gather the whole model as one unit, which every rank runs: zero.block_classes: [RankDependentBlocks]"
    ), r0
    assert r1.startswith(
        "SkippedBlockError: zero.stage 3: rank 1 gathered block 'blocks.2' while rank 0 gathered block "
        "'blocks.1'"
    ), r1


@pytest.mark.parametrize(
    "side_checks", [pytest.param(False, marks=pytest.mark.grid), True], ids=["gloo", "side-group"]
)
def test_a_block_one_rank_never_runs_is_named_on_every_rank(side_checks: bool) -> None:
    """Rank 0's forward ends without blocks.2 (it announces the end of its gathers) while ranks 1 and 2 gather
    it: all three name the block and rank 0, instead of waiting for a gather that never comes."""
    got = spawn(_train, 3, _cfg("skips_last", 3), side_checks)
    fix = (
        "gather the whole model as one unit, which every rank runs: zero.block_classes: [RankDependentBlocks]"
    )
    for r, message in enumerate(got):
        ran_on = "[12]" if r == 0 else str(r)
        assert re.match(
            rf"SkippedBlockError: zero\.stage 3: block 'blocks\.2' ran on rank {ran_on} but rank 0 skipped it "
            rf"in this forward \(a data-dependent block.*\); {re.escape(fix)}",
            message,
        ), (r, message)


class StoppedByTheLauncher(Exception):
    """A rank that had not read the codes when another rank left: torch elastic's agent stops every rank once
    one has failed (zoff train polls every 0.2 s), so this rank would never name the block."""


def _train_rank_0_leaving_first(rank: int, world: int, cfg_dict: dict, left: str) -> str:
    """_train over the side group, in the order that lost a report on a slow host: rank 0 leaves as soon as its
    error reaches the caller (marking it in the file `left`), while ranks 1 and 2 read the codes that name the
    skipped block only after a pause, and count as stopped by the launcher if rank 0 has left by then."""
    if rank != 0:
        check_codes = GatherChecks.check_codes

        def read_late(self, u: int, codes) -> None:
            time.sleep(2.0)  # (orders the ranks, asserts nothing about time)
            if Path(left).exists():
                raise StoppedByTheLauncher(f"rank 0 left before rank {rank} read the codes")
            check_codes(self, u, codes)

        GatherChecks.check_codes = read_late  # this rank's process only
    message = _train(rank, world, cfg_dict, side_checks=True)
    if rank == 0:
        Path(left).touch()
    return message


def test_a_skipped_block_is_named_on_every_rank_when_the_store_host_leaves_first(tmp_path) -> None:
    """Rank 0 (which hosts the store) finds the skipped block and leaves as soon as it may; the others read the
    codes late: every rank still names the block and rank 0, none is cut off before it reads them."""
    got = spawn(_train_rank_0_leaving_first, 3, _cfg("skips_last", 3), str(tmp_path / "rank-0-left"))
    for r, message in enumerate(got):
        assert re.match(
            rf"SkippedBlockError: zero\.stage 3: block 'blocks\.2' ran on rank {'[12]' if r == 0 else r} but rank 0 "
            r"skipped it in this forward",
            message,
        ), (r, message)


def _train_llama_dropping_its_last_layer_on_rank_0(rank: int, world: int, cfg_dict: dict) -> str:
    cfg = config_from_dict(cfg_dict)
    s = build_session(cfg, rank_device(rank))
    if rank == 0:  # a dropped layer (LayerDrop-style) on one rank: LlamaModel runs config.num_hidden_layers
        s.engine.model.config.num_hidden_layers -= 1
    try:
        train_loop(s)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "trained"


def test_a_hugging_face_layer_one_rank_drops_is_named_on_three_ranks(tmp_path) -> None:
    """Blocks from the model's own _no_split_modules (LlamaDecoderLayer), world 3: rank 0 skips the last
    layer; every rank names it and rank 0, and the fix gathers LlamaModel (which every rank runs) whole."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    cfg = tiny_cfg(
        model={"name": "hf:LlamaForCausalLM", "path": str(tmp_path / "llama"), "seq_len": 16},
        zero={"stage": 3, "param_persistence_threshold": 0},
        train={"max_steps": 2, "grad_accum": 1},
    )
    got = spawn(_train_llama_dropping_its_last_layer_on_rank_0, 3, cfg)
    fix = "gather it with the module that holds it, which every rank runs: zero.block_classes: [LlamaModel]"
    for r, message in enumerate(got):
        assert re.match(
            rf"SkippedBlockError: zero\.stage 3: block 'model\.layers\.2' ran on rank {'[12]' if r == 0 else r} "
            rf"but rank 0 skipped it in this forward .*; {re.escape(fix)}",
            message,
        ), (r, message)


def test_a_block_one_rank_skips_is_named_within_seconds_and_the_run_goes_on(tmp_path) -> None:
    """zoff train, stage 3, experts as the model's outermost blocks (the pattern zoo's outer_experts): a rank
    whose tokens skip an expert is named within seconds, with launch.timeout_s at its default (600 s),
    naming the block, the ranks and the key that fixes it; zoff train then restarts the ranks with that key
    and the run completes, its losses those of a run started with the key."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = [
        "model.name=python:tests.patterns.models:outer_experts", "model.seq_len=16", "data.seq_len=16",
        "data.batch_size=2", "data.synthetic_tokens=8000", "zero.stage=3", "zero.param_persistence_threshold=64",
        "train.max_steps=6", "train.log_every=1", "launch.nproc_per_node=2",
    ]  # fmt: skip

    started: list[subprocess.Popen] = []

    def start(run: str, *extra: str, stderr=subprocess.PIPE) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "zoff", "train", str(REPO / "configs" / "tiny.yaml"), *args, *extra]
        p = subprocess.Popen(
            [*cmd, "--run-dir", str(tmp_path / run)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
            stderr=stderr, text=True,
        )  # fmt: skip
        started.append(p)
        return p

    def train(run: str, *extra: str) -> tuple[int, str, float | None]:
        """(exit code, stderr, seconds until the restart was announced)."""
        t0 = time.monotonic()
        p = start(run, *extra)
        lines, announced = [], None
        for line in p.stderr:
            lines.append(line)
            if announced is None and line.startswith("zoff: restarting from"):
                announced = time.monotonic() - t0
        return p.wait(timeout=300), "".join(lines), announced

    def losses(run: str) -> list[float]:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    # The run started with the key goes alongside the one that must find it (the cores are idle for parts of a
    # run: a launcher's start-up and shut-down use one); its stderr goes to a file, read only if it fails.
    with open(tmp_path / "one-unit.stderr", "w") as one_unit_err:
        one_unit = start("one-unit", "zero.block_classes=[OuterExperts]", stderr=one_unit_err)
    try:
        code, err, announced = train("skipped")
        one_unit_code = one_unit.wait(timeout=300)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert code == 0, err
    # Named in forward, or (when the skipped expert was prefetched anyway) in backward, where only the ranks
    # that ran it gather it again.
    assert re.search(
        r"zero\.stage 3: (block 'blocks\.1' ran on rank [01] but rank [01] skipped it|rank [01] gathered "
        r"block 'blocks\.[01]' while rank [01] gathered block 'blocks\.[01]') in this (forward|backward)"
        r".*zero\.block_classes: \[OuterExperts\]",
        err,
    ), err
    assert "zoff: restarting from step 0 (no checkpoint yet), gathering every OuterExperts as one unit" in err
    assert announced is not None and announced < 30, f"{announced} s: the run waited for a collective timeout"
    assert "block_classes: [OuterExperts]" in (tmp_path / "skipped" / "config.yaml").read_text()
    assert one_unit_code == 0, (tmp_path / "one-unit.stderr").read_text()
    # metrics.jsonl holds each step once: the restart's, not the first attempt's
    assert losses("skipped") == losses("one-unit") and len(losses("one-unit")) == 6
