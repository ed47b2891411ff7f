"""The schedule harness: speculation forced on against off, bit for bit, under many orders of the engine's events.

zoff's schedules (the overlapped step, speculation, landings, the walk, the disk tier's read-ahead and
write-backs) are threads over shared buffers; an example-based test visits the orders its host happens to
produce. Here each case is drawn from a seed (`case_of`): stage, tiers, overlap_step, accumulation, precision
(fp16 with an overflow step), the clip (never, always, alternating, and set exactly at a step's measured norm:
factor 1 there, or just below it), a model whose units span 1 to many disk pieces, parameters unused on every
rank, on one rank or in some steps, world 1-3, and delays (`Delays`) injected into the disk tier's reads and
writes, the landing thread, the worker's start and each unit, with a tiny thread switch interval. The same run
goes once with speculation off and once forced on; losses, gradient norms, parameters, optimizer states and
the checkpoint's bytes must be equal bit for bit. Under the same delays, the run with speculation on is then
resumed from its checkpoint into a new engine and both take one step more (the same bits), and the case's twin
(`twin_of`: overlap_step flipped, or a host budget that keeps every state in RAM) must equal the run without. A failing case names its seed: `ZOFF_SCHEDULE_SEEDS=1234
python -m pytest -q -m schedules tests/integration/test_schedules.py` runs it again.

Planted faults (`FAULTS`, applied in the ranks) prove the harness can fail: each must make some case differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from tests.harness import spawn

NEVER, ALWAYS = 100.0, 0.05  # clip thresholds far above every norm of these models, and below every one


@dataclass(frozen=True)
class Case:
    """One schedule case, drawn from its seed (case_of)."""

    seed: int
    world: int
    stage: int
    opt: str  # the optimizer's tier: cpu (host memory) or nvme (the disk tier)
    par: str  # stage 3's parameters: none, cpu, nvme
    precision: str
    overlap: bool
    accum: int
    clip: str  # never, always, alternate, edge (factor exactly 1), below (factor just under 1 on one step)
    widths: tuple[int, ...]  # the wide layers' hidden widths: units of 1 to many disk pieces
    unused: str  # none, everywhere (a parameter no rank uses), one_rank, some_steps
    bucket: int  # reduce_bucket_size: how stages 1-2 group parameters into units
    steps: int
    drain: bool  # the step waits for the worker to take every landed unit (then some unit must commit)
    delay_ms: float  # the largest injected delay
    slow_writes_ms: float  # every disk write waits 0-2x this long first (a disk whose writes lag)
    budget: str = "min"  # the disk tier's host budget (twin_of: one that keeps every state in RAM)


def case_of(seed: int) -> Case:
    """The case a seed names (the same seed, the same case, on every machine)."""
    r = random.Random(seed)
    world = r.choice((1, 2, 2, 3))
    stage = r.choice((1, 2, 3, 3))
    opt = r.choice(("cpu", "nvme", "nvme"))
    par = r.choice(("none", "cpu", "nvme") if opt == "nvme" else ("none", "cpu")) if stage == 3 else "none"
    precision = r.choice(("fp32", "bf16", "bf16", "fp16"))
    return Case(
        seed=seed, world=world, stage=stage, opt=opt, par=par, precision=precision,
        overlap=stage == 3 and r.random() < 0.4, accum=r.choice((1, 1, 2, 3)),
        clip=r.choice(("never", "always", "alternate", "edge", "below", "below")),
        widths=tuple(r.choice((64, 3000, 6144, 12288)) for _ in range(r.choice((1, 2)))),
        unused=r.choice(("none", "everywhere", "one_rank", "some_steps")),
        bucket=r.choice((1500, 1 << 20)), steps=r.choice((3, 4)), drain=r.random() < 0.6,
        delay_ms=r.choice((0.0, 0.5, 2.0)), slow_writes_ms=r.choice((0.0, 0.0, 5.0, 30.0)),
    )  # fmt: skip


class ScheduleModel(nn.Module):
    """emb -> wide MLPs -> head, with the parameters a case asks for: an odd-sized one used every step
    (padding), and one `unused` as the case says (on every rank, on rank 0 only, in some steps)."""

    def __init__(self, widths: tuple[int, ...], unused: str, rank: int, vocab: int = 64, d: int = 32):
        super().__init__()
        # d+1 elements, first: a unit of its own, padded at every world size > 1, after the spare's in the walk
        self.odd = nn.Parameter(torch.randn(d + 1) * 0.1)
        self.emb = nn.Embedding(vocab, d)
        self.wide = nn.ModuleList(nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, d)) for w in widths)
        self.spare = nn.Parameter(torch.randn(d, d) * 0.1)
        self.head = nn.Linear(d, vocab)
        self.unused, self.rank, self.step = unused, rank, 0

    def uses_spare(self) -> bool:
        if self.unused == "everywhere":
            return False
        if self.unused == "one_rank":
            return self.rank != 0
        if self.unused == "some_steps":
            return self.step % 2 == 1  # every rank alike: the steps where no rank gives it a gradient
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.odd[:-1] * self.odd[-1]
        for mlp in self.wide:
            h = h + mlp(h)
        if self.uses_spare():
            h = h + h @ self.spare
        return self.head(h)


class Delays:
    """Seeded random delays in the engine's threads: the disk tier's reads and writes (each request, before
    it runs), the landing thread's tasks, the speculation worker's start and each unit it takes; and a thread
    switch interval of 10 us, so the interpreter changes threads mid-expression. Installed in one process
    (a rank), removed on exit."""

    def __init__(self, seed: int, most_ms: float, slow_writes_ms: float = 0.0):
        self.rng, self.most, self.writes = random.Random(seed), most_ms / 1000, slow_writes_ms / 1000
        self.lock = threading.Lock()

    def pause(self, lag: float = 0.0) -> None:
        """Sleep: half the time up to `most`; plus, for a write, 0 to 2x its lag (random, so that writes
        land out of the order they were issued in)."""
        with self.lock:
            dt = self.rng.random() * self.most if self.most and self.rng.random() < 0.5 else 0.0
            dt += 2 * lag * self.rng.random()
        if dt:
            time.sleep(dt)

    @contextmanager
    def installed(self):
        import zoff.engine.disk.swapfile as swapfile
        from zoff.engine.comm.landing import Landings
        from zoff.engine.step.optimizer import ShardOptimizer
        from zoff.engine.step.speculate import Speculation

        saved = [
            (
                swapfile,
                "_full",
                self._io(swapfile._full),
            ),  # every read and write request, on its pool's thread
            (Landings, "submit", self._before_task(Landings.submit)),
            (Speculation, "_work", self._before_call(Speculation._work)),
            (ShardOptimizer, "speculate_unit", self._before_call(ShardOptimizer.speculate_unit)),
        ]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in saved]
        interval = sys.getswitchinterval()
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        sys.setswitchinterval(1e-5)
        try:
            yield self
        finally:
            sys.setswitchinterval(interval)
            for owner, name, fn in originals:
                setattr(owner, name, fn)

    def _io(self, full):
        delays, pwritev = self, __import__("os").pwritev

        def request(op, *args):
            delays.pause(delays.writes if op is pwritev else 0.0)
            return full(op, *args)

        return request

    def _before_task(self, method):
        delays = self

        def submit(landings, fn):
            def slowed():
                delays.pause()
                fn()

            return method(landings, slowed)

        return submit

    def _before_call(self, method):
        delays = self

        def call(*args, **kwargs):
            delays.pause()
            return method(*args, **kwargs)

        return call


def _engine(case: Case, spec: bool, clip: float, swap: Path, rank: int):
    from zoff.config import (
        IoConfig,
        OffloadOptimizerConfig,
        OffloadParamConfig,
        OptimConfig,
        OptimizerIoConfig,
        ZeroConfig,
    )
    from zoff.engine import build_engine

    torch.manual_seed(case.seed)
    model = ScheduleModel(case.widths, case.unused, rank)
    nvme = case.opt == "nvme"
    # the disk tier streams every piece (a budget that keeps these small models' states in RAM leaves nothing
    # to speculate); the host tier has room for every unit's second buffers
    budget = case.budget if nvme else "64GiB"
    zero = ZeroConfig(
        stage=case.stage, reduce_bucket_size=case.bucket, param_persistence_threshold=64,
        offload_optimizer=OffloadOptimizerConfig(
            device=case.opt, nvme_path=str(swap) if nvme else None, host_budget=budget,
            io=OptimizerIoConfig(threads=2, request_mb=1, subgroup_mb=1), overlap_step=case.overlap,
            speculate=spec,
        ),
        offload_param=OffloadParamConfig(
            device=case.par, nvme_path=str(swap) if case.par == "nvme" else None,
            io=IoConfig(threads=2, request_mb=1),
        ),
    )  # fmt: skip
    return build_engine(
        model, zero, OptimConfig(lr=1e-2, weight_decay=0.1), precision=case.precision, grad_clip=clip,
        grad_accum=case.accum,
    )  # fmt: skip


def _drained(spec) -> None:
    """Wait (at most 30 s) until the worker has taken every landed unit."""
    deadline = time.monotonic() + 30
    while spec.active and not spec.queue.empty() and time.monotonic() < deadline:
        time.sleep(0.002)


def _train(eng, case: Case, rank: int) -> dict:
    """The case's steps on this rank's own batches; fp16 overflows on step 1 (loss times inf)."""
    gen = torch.Generator().manual_seed(case.seed * 7 + rank)
    losses, norms, commits = [], [], []
    for step in range(case.steps):
        loss, norm = _step(eng, case, step, gen)
        losses.append(loss)
        norms.append(norm)
        commits.append(dict(eng.speculation.last) if eng.speculation is not None else {})
    return {"losses": losses, "norms": norms, "commits": commits}


def _step(eng, case: Case, step: int, gen: torch.Generator) -> tuple[float, float]:
    """One step of the case (its loss, its global gradient norm)."""
    eng.model.step = step
    lr = 1e-2 * (1 + step) / case.steps  # a new lr every step: the worker must use the step's
    eng.zero_grad()
    for micro in range(case.accum):
        loss = eng.model(torch.randint(0, 64, (2, 16), generator=gen)).float().logsumexp(-1).mean()
        loss = loss / case.accum * (float("inf") if case.precision == "fp16" and step == 1 else 1.0)
        eng.backward(loss, sync=micro == case.accum - 1, lr=lr)
    if case.drain and eng.speculation is not None and eng.speculation.active:
        _drained(eng.speculation)
    return loss.item(), eng.step(lr).grad_norm


def _resumed(case: Case, eng, ckpt: Path, clip: float, swap: Path, rank: int) -> list[str]:
    """One step more of `eng`, and of a new engine resumed from its checkpoint `ckpt`: what differs (the
    resume is bit for bit under the same orders)."""
    from zoff.checkpoint import load_checkpoint

    results = []
    fresh = _engine(case, True, clip, swap, rank)
    try:
        load_checkpoint(fresh, ckpt)
        for e in (eng, fresh):
            loss, norm = _step(e, case, case.steps, torch.Generator().manual_seed(case.seed * 13 + rank))
            results.append({"losses": [loss], "norms": [norm], "files": {},
                            "tensors": {f"p.{k}": v for k, v in e.gathered_params().items()}})  # fmt: skip
    finally:
        fresh.close()
    return [f"resumed: {d}" for d in differences(*results)]


def _final(eng, ckpt: Path) -> dict:
    """What must be equal: the parameters, every unit's optimizer states, the checkpoint shard's bytes."""
    from zoff.checkpoint import save_checkpoint

    out = {f"p.{k}": v for k, v in eng.gathered_params().items()}
    for u in range(len(eng.plan.units)):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            out[f"u{u}.{kind}"] = eng.optimizer.read(u, kind).clone()
    folder = save_checkpoint(eng, ckpt, 1, {"step": 1}, "{}")
    digests = {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.glob("*.safetensors"))
        if not f.name.startswith("rng_")
    }
    return {"tensors": out, "files": digests, "folder": folder}


def clip_of(case: Case, norms: list[float]) -> float:
    """The case's clip from a first run's norms (clip never): `edge` puts it exactly where the largest step's
    factor is 1.0, `below` one part in a million under it (that step clips, by a factor a lax rule takes for
    1), `alternate` between the norms."""
    top = max(n for n in norms if n == n and n != float("inf"))
    if case.clip == "edge":
        return top + 1e-6  # clip_factor: min(clip / (norm + 1e-6), 1.0) is exactly 1.0 here
    if case.clip == "below":
        return (top + 1e-6) * (1 - 1e-6)
    if case.clip == "alternate":
        finite = sorted(n for n in norms if n == n and n != float("inf"))
        return (finite[0] + finite[-1]) / 2
    return {"never": NEVER, "always": ALWAYS}[case.clip]


def _run(
    case: Case, spec: bool, clip: float, swap: Path, rank: int, delays: Delays | None, resume: bool = False
) -> dict:
    """One run of the case (`resume`: then one step more against a new engine resumed from its checkpoint)."""
    tag = f"{spec}{case.overlap}{case.budget}{clip}"
    eng = _engine(case, spec, clip, swap / f"run{tag}", rank)
    try:
        with delays.installed() if delays is not None else _nothing():
            run = _train(eng, case, rank)
            run |= _final(eng, swap / f"ckpt{tag}")
            if resume:
                run["resume_diffs"] = _resumed(case, eng, run["folder"], clip, swap / f"resumed{tag}", rank)
            # a worker that failed turns speculation off and the steps walk: the same bits, but not a pass
            run["failed"] = spec and not eng.speculates
    finally:
        eng.close()
    return run


@contextmanager
def _nothing():
    yield


def differences(off: dict, on: dict) -> list[str]:
    """What differs between the two runs of a case (empty: the same bits)."""
    out = []
    for key in ("losses", "norms"):
        a, b = off[key], on[key]
        if not all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True)):
            out.append(f"{key}: off {a} on {b}")
    for name, t in off["tensors"].items():
        if not torch.equal(on["tensors"][name], t):
            out.append(f"{name}: max |diff| {(on['tensors'][name] - t).abs().max().item():.3g}")
    if off["files"] != on["files"]:
        out.append(f"checkpoint bytes: off {off['files']} on {on['files']}")
    return out


def case_rank(rank: int, world: int, cases: list[Case], swap: str, fault: str | None) -> list[dict]:
    """One rank of many cases in one spawn: each case's differences and commit counts (a case that raises is
    reported as its error, and the next case goes on)."""
    from tests.schedule_faults import planted

    out = []
    with planted(fault):
        for case in cases:
            folder = Path(swap) / f"case{case.seed}"
            try:
                out.append(_case(case, folder, rank))
            except Exception as e:  # reported by the parent with the seed
                out.append({"seed": case.seed, "error": f"{type(e).__name__}: {e}"})
    return out


def _case(case: Case, folder: Path, rank: int) -> dict:
    """Speculation off, on (then resumed), and the case's twin (speculation off): all the same bits."""
    clip = NEVER if case.clip == "never" else ALWAYS
    if case.clip in ("edge", "below", "alternate"):
        clip = clip_of(case, _run(case, False, NEVER, folder / "probe", rank, None)["norms"])
    off = _run(case, False, clip, folder, rank, Delays(case.seed, case.delay_ms, case.slow_writes_ms))
    on = _run(case, True, clip, folder, rank, Delays(case.seed + 1, case.delay_ms, case.slow_writes_ms), True)
    diffs = differences(off, on) + on["resume_diffs"] + (["the worker failed"] if on["failed"] else [])
    twin, what = twin_of(case), None
    if twin is not None:
        other = _run(
            twin, False, clip, folder, rank, Delays(case.seed + 2, case.delay_ms, case.slow_writes_ms)
        )
        what = "overlap_step" if twin.overlap != case.overlap else "host budget"
        diffs += [f"{what} {getattr(twin, 'overlap' if what == 'overlap_step' else 'budget')}: {d}"
                  for d in differences(off, other)]  # fmt: skip
    committed = sum(c.get("committed", 0) for c in on["commits"])
    speculated = sum(c.get("speculated", 0) for c in on["commits"])
    return {"seed": case.seed, "diffs": diffs, "committed": committed, "speculated": speculated,
            "norms": off["norms"], "twin": what}  # fmt: skip


def twin_of(case: Case) -> Case | None:
    """The case with one thing changed that must not change a bit (drawn from the seed): overlap_step flipped
    (stage 3 with the optimizer offloaded), or the disk tier's host budget holding every state in RAM."""
    choices = []
    if case.stage == 3:
        choices.append(replace(case, overlap=not case.overlap))
    if case.opt == "nvme":
        choices.append(replace(case, budget="64GiB"))
    return random.Random(case.seed + 3).choice(choices) if choices else None


def run_cases(cases: list[int | Case], swap: Path, fault: str | None = None) -> list[dict]:
    """Every case (a seed, or a Case made by hand), grouped by world size (one spawn per world); each case's
    rank reports merged: its differences on any rank, prefixed by the rank."""
    by_world: dict[int, list[Case]] = {}
    for c in cases:
        case = c if isinstance(c, Case) else case_of(c)
        by_world.setdefault(case.world, []).append(case)
    reports = []
    for world, group in sorted(by_world.items()):
        reports += _spawned(world, group, swap, fault)
    _record(reports)
    return reports


def _record(reports: list[dict]) -> None:
    """ZOFF_SCHEDULE_REPORT=FILE: every case's report appended to FILE as a JSON line (the seed, the case, its
    differences, errors and commit counts), as the cases finish."""
    path = os.environ.get("ZOFF_SCHEDULE_REPORT")
    if path:
        with open(path, "a") as f:
            for r in reports:
                f.write(json.dumps(r, default=str) + "\n")


def _spawned(world: int, group: list[Case], swap: Path, fault: str | None) -> list[dict]:
    """One spawn's reports. A rank that dies (gloo aborts a collective whose sizes differ between ranks) takes
    the spawn with it: each case then runs in a spawn of its own, and the one that dies is reported so."""
    try:
        ranks = spawn(case_rank, world, group, str(swap), fault)
    except RuntimeError as e:
        if len(group) > 1:
            return [r for case in group for r in _spawned(world, [case], swap, fault)]
        why = str(e).strip().splitlines()[-1]
        return [{"seed": group[0].seed, "case": asdict(group[0]), "diffs": [], "errors": [f"crashed: {why}"],
                 "committed": [0] * world, "speculated": [0] * world, "norms": None}]  # fmt: skip
    reports = []
    for i, case in enumerate(group):
        per_rank = [r[i] for r in ranks]
        diffs = [f"rank {r}: {d}" for r, rep in enumerate(per_rank) for d in rep.get("diffs", ())]
        errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(per_rank) if "error" in rep]
        reports.append({"seed": case.seed, "case": asdict(case), "diffs": diffs, "errors": errors,
                        "committed": [rep.get("committed", 0) for rep in per_rank],
                        "speculated": [rep.get("speculated", 0) for rep in per_rank],
                        "norms": per_rank[0].get("norms"), "twin": per_rank[0].get("twin")})  # fmt: skip
    return reports


def expects_commits(case: Case, norms: list[float] | None) -> bool:
    """Whether the case must commit some unit: the worker drained before each step, no unit waits for a
    parameter no rank gave a gradient (unused everywhere or in some steps, a unit holding it may be the
    model's only one; at world 1 `one_rank` is everywhere), and some step of the run without speculation
    (`norms`) had a finite norm and a factor of 1 (`below` clips the largest; fp16 may overflow every step
    after its first). Checked against the 500-case run's reports: 75 cases expect commits, all made some."""
    finite = [n for n in norms or [] if n == n and n != float("inf")]
    clipped = {"never": 0, "edge": 0, "below": 1}.get(case.clip)
    unblocked = case.unused == "none" or (case.unused == "one_rank" and case.world > 1)
    return case.drain and unblocked and clipped is not None and len(finite) > clipped


def verdict(report: dict) -> str:
    """One line naming the seed that reproduces a failing case (empty when it passed)."""
    if not report["diffs"] and not report["errors"]:
        return ""
    what = (report["errors"] or report["diffs"])[:3]
    return f"seed {report['seed']} ({report['case']}): " + "; ".join(what)
