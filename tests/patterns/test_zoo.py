"""The pattern zoo: every ZeRO stage equals plain single-process PyTorch on models built like real ones.

Each cell of the grid trains one pattern of tests/patterns/models.py for 12 steps under one ZeRO stage on 2
or 3 gloo ranks, with or without gradient accumulation, and compares per-step losses, per-step global
gradient norms and final parameters with tests.harness.reference_run (one forward over the whole global
batch, torch.optim.AdamW, clip_grad_norm_) within 1e-5 relative.

Where a cell misses the fp32 reference, it is compared once more with the same reference trained in float64
from the same initial values (the exact run that every fp32 order of summation approximates), and passes if it
matches that within the same 1e-5: the fp32 reference is itself one order of summation, and Adam can carry
its rounding past 1e-5 alone. At 3 ranks with accumulation 3, functional_tie's fp32 reference lies 1.98e-5
from the float64 run on an AVX2 host, where zoff lies within 1.4e-6 of it at every stage (and so 2.08e-5 from
the fp32 one). Not the first comparison for every cell: the fp32 reference shares more of zoff's rounding, and
against float64 zoff's own fp32 rounding is itself ~1e-5 in some cells (ckpt_block at 2 ranks: 1.005e-5).

- default suite (`-m slow` selects it too): world 2, grad_accum 3, every pattern x stages 1 and 3, plus
  stage 0 of moe and branch, all in one spawn; the disk tier (zero3-nvme, and the overlapped step on disk
  and in host memory) for the four patterns that stress the walk's order;
- speculation forced on against off, bit for bit, some unit committed in each cell (the clip far above
  every norm): the four walk-order patterns on disk and in host memory by default, every pattern on disk,
  with the overlapped step and in host memory in `-m grid`;
- full grid (`-m grid`): every pattern x stages 0-3 x world 2, 3 x grad_accum 1, 3, one spawn per
  (world, grad_accum). Marked `slow` as well, so `-m "not slow"` never picks it up.

Cells do not share fate: an engine bug can raise on one rank only, abort a rank in native code (gloo's
collective size check) or deadlock, and any of these would otherwise sink every later cell of the spawn. A
failed cell ends its spawn after recording each rank's error (or a native abort's last output), and the
cells after it run in a fresh spawn. A crash is reported as `crashed: ...`; a mismatch as the first step or
parameter that differs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

import tests.harness as harness
from tests.harness import (
    assert_close_losses,
    assert_close_params,
    held_port,
    reference_run,
    tiny_cfg,
    zoff_rank,
)
from tests.patterns import models
from zoff.config import Config, config_from_dict
from zoff.data import GlobalBatches, load_corpus
from zoff.data.batch import MicroBatch
from zoff.engine import build_engine
from zoff.models import build_model

PATTERNS = list(models.PATTERNS)
STAGES = (0, 1, 2, 3)
WORLDS = (2, 3)
ACCUMS = (1, 3)
STEPS = 12

# The default slice: accumulation on, stages 1 and 3 (the optimizer states' partition, and the parameters'
# with every gather; stage 2, the gradients' partition between them, is in -m grid and in the default suite's
# tests/integration/test_engine_equivalence.py), and the two data-dependent patterns under plain data
# parallelism too (a stage-0 failure there points at the model, not at ZeRO).
# scripts/gpu_check.sh runs the slice at world 1 on a single GPU (ZOFF_TEST_WORLD=1).
SLICE_WORLD, SLICE_ACCUM = int(os.environ.get("ZOFF_TEST_WORLD", "2")), 3
SLICE = [(p, s) for p in PATTERNS for s in (1, 3)] + [("moe", 0), ("moe_idle_expert", 0), ("branch", 0)]
# Stage 3 with parameters and optimizer states on disk (zero3-nvme): its gathers read shards from a swap file
# and issue their all-gathers late, and its step writes the shards back; every pattern must still match.
DISK = "3-nvme"
# ... and with the overlapped step (zero.offload_optimizer.overlap_step): the walk runs while the next forward
# gathers, each gather waiting for its unit's update; the same numbers
OVERLAP = "3-nvme-overlap"
# ... and with everything in host memory (zero3-offload): the walk is the CPU Adam alone, writing the host shards
OFFLOAD_OVERLAP = "3-offload-overlap"
# by default a few patterns that stress the walk's order (checkpointed recompute, data-dependent experts, a
# weight read outside its block, whole-model units), on disk with and without the overlapped step and in host
# memory with it; every pattern in -m grid (a disk cell takes ~4 s on 2 cores: the 14 patterns are a minute)
OVERLAP_DEFAULT = ("ckpt_block", "moe", "functional_tie", "layer_drop")
DISK_SLICE = [(p, s) for s in (DISK, OVERLAP, OFFLOAD_OVERLAP) for p in OVERLAP_DEFAULT]
FULL = [(p, s) for p in PATTERNS for s in (*STAGES, DISK, OVERLAP, OFFLOAD_OVERLAP)]
GRID = [(w, a, p, s) for w in WORLDS for a in ACCUMS for p, s in FULL]

# The zoo with speculation forced on against off, bit for bit, and some unit committed in every cell (the
# clip far above every norm, so every step may commit): the walk-order patterns on disk and in host memory by
# default, every pattern on disk, with the overlapped step and in host memory in -m grid.
SPEC_SLICE = [(p, s) for s in (DISK, OFFLOAD_OVERLAP) for p in OVERLAP_DEFAULT]
SPEC_FULL = [(p, s) for p in PATTERNS for s in (DISK, OVERLAP, OFFLOAD_OVERLAP)]
SPEC_CLIP = 100.0

# ZOFF_ZOO_SPECULATE=1: the offload cells speculate every step (zero.offload_optimizer.speculate: true; the
# default, auto, speculates on the disk cells only after a step that did not clip): the zoo with exact
# speculation forced on, its commits and discards against plain PyTorch
# (=0: speculate false there, the comparison's other side)
SPECULATE = {"1": True, "0": False}.get(os.environ.get("ZOFF_ZOO_SPECULATE", ""), "auto")

# A collective waiting longer than this is an error (healthy cells take about a second); the parent gives a
# spawn this long past its last finished cell before it kills the ranks and calls the cell hung.
COLLECTIVE_TIMEOUT_S = 60
SWAP_DIR: str | None = None
STARTUP_S = 120


def _swap_dir() -> str:
    """The disk cells' swap folder, on the real disk (each rank's subfolder is removed when its engine closes)."""
    base = "/var/tmp" if Path("/var/tmp").is_dir() else None
    path = tempfile.mkdtemp(prefix="zoff-zoo-", dir=base)
    atexit.register(shutil.rmtree, path, True)
    return path


def cell_cfg(pattern: str, stage: int | str, accum: int) -> dict:
    # persistence threshold 64 keeps norms and biases in persistent units and gathers the matrices at stage
    # 3; a 3000-element bucket splits the model into several units, so reduction overlaps backward.
    zero = {"stage": stage, "param_persistence_threshold": 64, "reduce_bucket_size": 3000}
    if (
        stage in (3, DISK, OVERLAP, OFFLOAD_OVERLAP) and pattern in models.WHOLE_MODEL_UNIT
    ):  # blocks some rank skips: one unit
        zero["block_classes"] = [models.WHOLE_MODEL_UNIT[pattern]]
    if stage == OFFLOAD_OVERLAP:
        zero |= {"stage": 3, "offload_param": {"device": "cpu"},
                 "offload_optimizer": {"device": "cpu", "overlap_step": True}}  # fmt: skip
    if stage == OFFLOAD_OVERLAP and SPECULATE != "auto":
        zero["offload_optimizer"]["speculate"] = True
    if stage in (DISK, OVERLAP):
        global SWAP_DIR
        SWAP_DIR = SWAP_DIR or _swap_dir()
        zero |= {"stage": 3, "offload_param": {"device": "nvme"},
                 "offload_optimizer": {"device": "nvme", "nvme_path": SWAP_DIR, "host_budget": "min",
                                       "overlap_step": stage == OVERLAP, "speculate": SPECULATE}}  # fmt: skip
    return tiny_cfg(
        model={
            "name": f"python:tests.patterns.models:{pattern}",
            "d_model": 32,
            "vocab_size": 256,
            "n_layer": 2,
        },
        zero=zero,
        train={"grad_accum": accum, "grad_clip": 0.5, "max_steps": STEPS},
    )


# ------------------------------------------------------------------------------------ isolated cell runs


def _describe(e: BaseException) -> str:
    """The error and where it was raised: the innermost frame, and the innermost one in zoff/ if another."""
    frames = traceback.extract_tb(e.__traceback__)
    where = [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in frames[-1:]]
    ours = [f for f in frames if f"{os.sep}zoff{os.sep}" in f.filename]
    if ours and ours[-1] is not frames[-1]:
        where.append(f"{Path(ours[-1].filename).name}:{ours[-1].lineno} in {ours[-1].name}")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first} [{' <- '.join(where)}]"


def _mark(out: Path, cell: int, rank: int, ok: bool) -> None:
    (out / f"cell{cell}-rank{rank}.{'ok' if ok else 'err'}").touch()


def _marks(out: Path, cell: int, world: int) -> dict[int, bool]:
    """rank -> whether it finished the cell without error, for the ranks that have reported."""
    got = {}
    for r in range(world):
        if (out / f"cell{cell}-rank{r}.ok").exists():
            got[r] = True
        elif (out / f"cell{cell}-rank{r}.err").exists():
            got[r] = False
    return got


def _log_tail(out: Path, rank: int, lines: int = 3) -> str:
    path = out / f"rank{rank}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])[-600:]


def _cells_entry(rank: int, world: int, port: int, cfgs: list[dict], out_dir: str) -> None:
    """One rank: run the cells in order; after each, wait for every rank's verdict and stop at the first
    failure anywhere (a failed cell leaves the process group out of step, so no later cell may use it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    out = Path(out_dir)
    # This rank's stdout/stderr (C++ included) go to a file: a rank that aborts in native code leaves its
    # last words there (gloo's `terminate called after throwing ...`), and the parent quotes them.
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    harness.init_rank(rank, world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    for i, cfg in enumerate(cfgs):
        try:
            record = zoff_rank(rank, world, cfg)
            ok = True
        except Exception as e:  # noqa: BLE001 - the error is the cell's result
            record, ok = {"error": _describe(e)}, False
        tmp = out / f"cell{i}-rank{rank}.pt.tmp"
        torch.save(record, tmp)
        os.replace(tmp, out / f"cell{i}-rank{rank}.pt")
        _mark(out, i, rank, ok)
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S + 10
        while ok and len(marks := _marks(out, i, world)) < world and time.monotonic() < deadline:
            time.sleep(0.01)  # the ranks finish a cell together: its last step ends in a collective
        if not ok or not (len(marks) == world and all(marks.values())):
            # Exit at once, without tearing the group down: a rank still blocked in a collective of this cell
            # then sees its peers' connections close and fails now instead of after the timeout.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    dist.destroy_process_group()


def _spawn_until_failure(cfgs: list[dict], world: int) -> list[dict]:
    """Run cfgs in one spawn until a cell fails; return rank 0's result of each finished cell, the failed one
    last as {"error": ...}. Never returns an empty list."""
    port, hold = held_port()
    with tempfile.TemporaryDirectory() as tmp, hold:
        out = Path(tmp)
        ctx = mp.start_processes(
            _cells_entry,
            args=(world, port, cfgs, tmp),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        deadline, finished, died = time.monotonic() + STARTUP_S, 0, ""
        while True:
            try:
                if ctx.join(timeout=0.5):
                    break
            except ProcessException as e:  # a rank died outside any cell's try (a signal, say)
                died = f"{type(e).__name__}: {e}"
                break
            while finished < len(cfgs) and len(_marks(out, finished, world)) == world:
                finished += 1
                deadline = time.monotonic() + STARTUP_S
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                died = f"hung: no cell finished within {STARTUP_S}s"
                break
        results: list[dict] = []
        for i in range(len(cfgs)):
            marks = _marks(out, i, world)
            if len(marks) == world and all(marks.values()):
                results.append(torch.load(out / f"cell{i}-rank0.pt", weights_only=False))
                continue
            errors = [
                f"rank {r}: {torch.load(out / f'cell{i}-rank{r}.pt', weights_only=False)['error']}"
                for r in sorted(marks)
                if not marks[r]
            ]
            missing = [r for r in range(world) if r not in marks]
            if missing:
                errors.append(f"rank(s) {', '.join(map(str, missing))} gave no result ({died or 'exited'})")
                errors += [
                    f"rank {r}'s last output: {_log_tail(out, r)}" for r in missing if _log_tail(out, r)
                ]
            results.append({"error": "; ".join(errors)})
            break
        return results


def run_cells(cfgs: list[dict], world: int) -> list[dict]:
    """Rank 0's result of each config (as tests.harness.run_zoff_many), or {"error": ...} for a cell that
    crashed or hung on any rank; the cells run in as few spawns as their failures allow."""
    results: list[dict] = []
    while len(results) < len(cfgs):
        results += _spawn_until_failure(cfgs[len(results) :], world)
    return results


class Zoo:
    """The runs of one test session: zoff cells per (world, accum), run lazily, the missing ones of a group
    in one spawn; references computed in-process and cached per (pattern, world, accum)."""

    def __init__(self) -> None:
        self.runs: dict[tuple[int, int, str, int], dict] = {}
        self.refs: dict[tuple[str, int, int, torch.dtype], dict] = {}

    def run(self, world: int, accum: int, cells: Iterable[tuple[str, int]]) -> None:
        missing = [c for c in cells if (world, accum, *c) not in self.runs]
        if missing:
            got = run_cells([cell_cfg(p, s, accum) for p, s in missing], world)
            for (p, s), result in zip(missing, got, strict=True):
                self.runs[(world, accum, p, s)] = result

    def reference(self, pattern: str, world: int, accum: int, dtype: torch.dtype = torch.float32) -> dict:
        key = (pattern, world, accum, dtype)
        if key not in self.refs:  # the reference ignores zero.*: stage 0's config stands for all stages
            cfg = config_from_dict(cell_cfg(pattern, 0, accum))
            self.refs[key] = reference_run(cfg, world, dtype=dtype)
        return self.refs[key]

    def check(self, world: int, accum: int, pattern: str, stage: int, group: list[tuple[str, int]]) -> None:
        self.run(world, accum, group)
        got = self.runs[(world, accum, pattern, stage)]
        if "error" in got:
            pytest.fail(f"crashed: {got['error']}", pytrace=False)
        ref = self.reference(pattern, world, accum)
        try:
            _assert_matches(got, ref)
        except AssertionError as fp32_miss:  # (the module docstring: the exact run, once more)
            try:
                _assert_matches(got, self.reference(pattern, world, accum, torch.float64))
            except AssertionError as exact_miss:
                raise AssertionError(f"{fp32_miss}; against the float64 run: {exact_miss}") from None
        assert ref["losses"][-1] < ref["losses"][0]  # the comparison is over a run that actually learns
        # A gradient after its unit was sent costs a second reduction: only a hook that fires twice does that,
        # and only until the engine has learned it (the first backward).
        assert got["stats"]["late_corrections"] <= (1 if pattern == "ckpt_shared_reentrant" else 0)


def _assert_matches(got: dict, ref: dict) -> None:
    assert_close_losses(got["losses"], ref["losses"])
    assert_close_losses(got["grad_norms"], ref["grad_norms"])
    assert_close_params(got["params"], ref["params"])


def spec_cfg(pattern: str, stage: str, accum: int, spec: bool) -> dict:
    """A disk or host-offload cell with speculation forced on or off, and a clip that never triggers."""
    cfg = cell_cfg(pattern, stage, accum)
    cfg["zero"]["offload_optimizer"]["speculate"] = spec
    cfg["train"]["grad_clip"] = SPEC_CLIP
    return cfg


def check_speculation(zoo: Zoo, pattern: str, stage: str, group: list[tuple[str, str]]) -> None:
    """The cell with speculation on equals it off, bit for bit (losses, norms, parameters); some unit committed."""
    key = (SLICE_WORLD, SLICE_ACCUM, "spec", pattern, stage)
    if key not in zoo.runs:
        cells = [(p, s, spec) for p, s in group for spec in (False, True)]
        got = run_cells([spec_cfg(p, s, SLICE_ACCUM, spec) for p, s, spec in cells], SLICE_WORLD)
        for (p, s, spec), result in zip(cells, got, strict=True):
            zoo.runs[(SLICE_WORLD, SLICE_ACCUM, "spec" if spec else "nospec", p, s)] = result
    off, on = zoo.runs[(SLICE_WORLD, SLICE_ACCUM, "nospec", pattern, stage)], zoo.runs[key]
    for got in (off, on):
        if "error" in got:
            pytest.fail(f"crashed: {got['error']}", pytrace=False)
    assert on["losses"] == off["losses"]
    assert on["grad_norms"] == off["grad_norms"]
    for name, t in off["params"].items():
        assert torch.equal(on["params"][name], t), name
    assert on["stats"]["speculation"]["committed_units"] > 0, on["stats"]["speculation"]
    assert off["stats"]["speculation"] is None


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


@pytest.mark.slow
@pytest.mark.parametrize(("pattern", "stage"), SLICE, ids=[f"{p}-s{s}" for p, s in SLICE])
def test_slice(zoo: Zoo, pattern: str, stage: int) -> None:
    zoo.check(SLICE_WORLD, SLICE_ACCUM, pattern, stage, SLICE)


@pytest.mark.slow
@pytest.mark.parametrize(("pattern", "stage"), DISK_SLICE, ids=[f"{p}-{s}" for p, s in DISK_SLICE])
def test_slice_on_disk(zoo: Zoo, pattern: str, stage: str) -> None:
    zoo.check(SLICE_WORLD, SLICE_ACCUM, pattern, stage, DISK_SLICE)


@pytest.mark.slow
@pytest.mark.parametrize(("pattern", "stage"), SPEC_SLICE, ids=[f"{p}-{s}" for p, s in SPEC_SLICE])
def test_speculation_on_equals_off(zoo: Zoo, pattern: str, stage: str) -> None:
    check_speculation(zoo, pattern, stage, SPEC_SLICE)


@pytest.mark.slow
@pytest.mark.grid
@pytest.mark.parametrize(("pattern", "stage"), SPEC_FULL, ids=[f"{p}-{s}" for p, s in SPEC_FULL])
def test_grid_speculation_on_equals_off(zoo: Zoo, pattern: str, stage: str) -> None:
    check_speculation(zoo, pattern, stage, SPEC_FULL)


@pytest.mark.slow
@pytest.mark.grid
@pytest.mark.parametrize(
    ("world", "accum", "pattern", "stage"), GRID, ids=[f"w{w}-a{a}-{p}-s{s}" for w, a, p, s in GRID]
)
def test_grid(zoo: Zoo, world: int, accum: int, pattern: str, stage: int) -> None:
    zoo.check(world, accum, pattern, stage, FULL)


# ------------------------------------------------------------------------ the models keep the zoo's rules


@pytest.mark.parametrize("pattern", PATTERNS)
def test_models_are_per_sample_independent_and_deterministic(pattern: str) -> None:
    """Split into micro-batches or not, each sample's logits are the same; the same seed builds the same model."""
    cfg = config_from_dict(cell_cfg(pattern, 0, 3))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    torch.manual_seed(0)
    again = build_model(cfg.model)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.model.n_layer
    batches = _batches(SLICE_WORLD, SLICE_ACCUM)
    x = torch.cat([batches[(0, r, m)].inputs for r in range(SLICE_WORLD) for m in range(SLICE_ACCUM)])
    whole = model(x)  # training mode: the checkpointed models recompute, as in the runs
    split = torch.cat([model(x[i : i + 2]) for i in range(0, len(x), 2)])
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert whole.shape == (*x.shape, cfg.model.vocab_size)
    assert all(p.dtype == torch.float32 for p in model.parameters())


_BATCHES: dict[tuple[int, int], dict] = {}


def _batches(world: int, accum: int) -> dict[tuple[int, int, int], MicroBatch]:
    """(step, rank, micro) -> that micro-batch's (inputs, targets), exactly as the zoo's ranks read them."""
    if (world, accum) not in _BATCHES:
        cfg = config_from_dict(cell_cfg("branch", 0, accum))
        corpus = load_corpus(cfg.data, cfg.train.seed)
        got = {}
        for rank in range(world):
            b = GlobalBatches(
                corpus, cfg.data.seq_len, cfg.data.batch_size, accum, rank, world, cfg.train.seed
            )
            for step in range(STEPS):
                for micro in range(accum):
                    got[(step, rank, micro)] = b.micro_batch_at(step, micro)
        _BATCHES[(world, accum)] = got
    return _BATCHES[(world, accum)]


def _usage(world: int, accum: int, uses) -> torch.Tensor:
    """used[step, rank, micro]: whether `uses(inputs)` holds for some sample of that micro-batch."""
    b = _batches(world, accum)
    return torch.tensor(
        [
            [[bool(uses(b[(s, r, m)].inputs).any()) for m in range(accum)] for r in range(world)]
            for s in range(STEPS)
        ]
    )


def _skipped_on_rank0_used_elsewhere(used: torch.Tensor) -> list[int]:
    """Steps in which some micro-batch of rank 0 does not use it while another rank does: used[step, rank, micro]."""
    return [s for s in range(used.shape[0]) if not used[s, 0].all() and used[s, 1:].any()]


def _assert_never_unused_by_a_whole_step(used: torch.Tensor, what: str) -> None:
    # Otherwise the reference leaves it with grad None and AdamW skips it, while ZeRO steps it with zeros:
    # a different question from the zoo's (see models.py's docstring).
    whole = [s for s in range(used.shape[0]) if not used[s].any()]
    assert not whole, f"{what} is unused by the whole global batch of step(s) {whole}"


def test_skipped_blocks_are_skipped_by_some_rank_and_used_by_every_step() -> None:
    """outer_experts and layer_drop: a block some micro-batch of rank 0 skips while another rank runs it, and
    no block unused by a whole step's global batch (every world and accumulation of the grid)."""
    layer_drop, outer = models.LayerDrop.condition, models.OuterExperts.route
    skipped = {"layer_drop": [], "outer_experts": []}
    for world in WORLDS:
        for accum in ACCUMS:
            for i in range(2):
                uses = {"layer_drop": lambda x, i=i: layer_drop(x, i),
                        "outer_experts": lambda x, i=i: (outer(x, 2) == i).any(-1)}  # fmt: skip
                for pattern, use in uses.items():
                    used = _usage(world, accum, use)
                    _assert_never_unused_by_a_whole_step(used, f"{pattern} block {i} ({world}, {accum})")
                    skipped[pattern] += _skipped_on_rank0_used_elsewhere(used)
    assert all(skipped.values()), skipped


@pytest.mark.parametrize("pattern", ["branch", "last_micro_unused"])
def test_branches_really_are_skipped(pattern: str) -> None:
    """The conditional parameters are skipped by some micro-batches of rank 0 in a step in which another
    rank uses them, and never by a whole step, in every (world, accum) of the grid."""
    condition = {"branch": models.Branch, "last_micro_unused": models.LastMicroUnused}[pattern].condition
    for world in WORLDS:
        for accum in ACCUMS:
            used = _usage(world, accum, condition)
            _assert_never_unused_by_a_whole_step(used, f"{pattern} (world {world}, accum {accum})")
            if (world, accum) == (SLICE_WORLD, SLICE_ACCUM):
                assert _skipped_on_rank0_used_elsewhere(used), pattern
    if pattern == "last_micro_unused":
        # accumulation 3 on 2 ranks: rank 0 uses it in micro-batch 1 or 2 of a step but not in micro-batch 3
        used = _usage(2, 3, condition)
        assert [s for s in range(STEPS) if used[s, 0, :-1].any() and not used[s, 0, -1]]


def _routing(world: int, accum: int, monkeypatch: pytest.MonkeyPatch, pattern: str = "moe") -> torch.Tensor:
    """used[step, block, expert, rank, micro] along the reference's own trajectory (the routing moves as the
    router trains; zoff follows the same trajectory when it matches the reference)."""
    calls: list[torch.Tensor] = []

    def build(cfg) -> torch.nn.Module:
        model = build_model(cfg)
        for block in model.blocks:
            block.router.register_forward_hook(
                lambda mod, args, logits: calls.append(logits.detach().topk(models.TOP_K, dim=-1).indices)
            )
        return model

    monkeypatch.setattr(harness, "build_model", build)
    cfg: Config = config_from_dict(cell_cfg(pattern, 0, accum))
    reference_run(cfg, world)
    monkeypatch.undo()
    n_block, mb = cfg.model.n_layer, cfg.data.batch_size
    assert len(calls) == STEPS * n_block  # one forward per step over the whole global batch
    used = torch.zeros(STEPS, n_block, models.N_EXPERTS, world, accum, dtype=torch.bool)
    for i, chosen in enumerate(calls):
        step, block = divmod(i, n_block)
        per_sample = chosen.view(world, accum, mb, -1)  # the global batch is rank-major, then micro-batch
        for e in range(models.N_EXPERTS):
            used[step, block, e] = (per_sample == e).flatten(2).any(-1)
    return used


def test_moe_experts_really_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Some expert gets no token in some micro-batch of rank 0 while another rank routes tokens to it in
    the same step; and every expert gets tokens in every step's global batch."""
    for world in WORLDS:
        for accum in ACCUMS:
            used = _routing(world, accum, monkeypatch)
            skipped = []
            for block in range(used.shape[1]):
                for e in range(models.N_EXPERTS):
                    what = f"expert {e} of block {block} (world {world}, accum {accum})"
                    _assert_never_unused_by_a_whole_step(used[:, block, e], what)
                    skipped += _skipped_on_rank0_used_elsewhere(used[:, block, e])
            assert skipped, (world, accum)


def test_idle_expert_really_is_idle_for_whole_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_idle_expert's last expert gets no token in the whole global batch of some steps (torch then skips
    it entirely) and some in others (so skipping it is not the same as never training it)."""
    for world in WORLDS:
        for accum in ACCUMS:
            used = (
                _routing(world, accum, monkeypatch, "moe_idle_expert")[:, :, -1].flatten(2).any(-1)
            )  # [step, block]
            idle = [s for s in range(STEPS) if not used[s].all()]
            assert idle and used.any(0).all(), (world, accum, used.tolist())


# ----------------------------------------------------------------------------------- precision of buffers


@pytest.mark.parametrize("stage", STAGES)
def test_buffers_keep_fp32_under_bf16(stage: int) -> None:
    """Mixed precision computes in bf16 but must leave fp32 buffers (rotary inv_freq, scales) fp32."""
    cfg = config_from_dict(cell_cfg("buffers", stage, 1))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine = build_engine(model, cfg.zero, cfg.optim, precision="bf16")  # world 1: no process group
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}  # bf16 did take effect
    cast = {n: b.dtype for n, b in engine.model.named_buffers() if b.dtype != torch.float32}
    assert not cast, f"buffers cast by the engine: {cast}"
