"""The schedule harness (tests/schedules.py): speculation forced on equals off, bit for bit, across seeded cases
that vary the configuration and the order of the engine's threads' events; the two orders that broke it at
51a0203, pinned; and planted faults, each caught.

- default suite: SLICE (fixed seeds covering worlds 1-3, both tiers, every clip mode and precision) and the
  pinned reproductions and planted faults;
- `python -m pytest -q -n 2 -m schedules`: SCHEDULE_CASES seeds more, in chunks of CHUNK (ZOFF_SCHEDULE_CASES, default 500; or
  ZOFF_SCHEDULE_SEEDS=1,2,3 for given ones: what a failing case's message says to run).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tests.schedule_faults import FAULTS
from tests.schedules import Case, case_of, expects_commits, run_cases, verdict

# fixed seeds of the default suite, chosen to span the axes (world, stage, tier, clip, precision, unused)
SLICE = [1, 3, 4, 5, 6, 10, 11, 13]
SCHEDULE_CASES = int(os.environ.get("ZOFF_SCHEDULE_CASES", "500"))
SEEDS = [int(s) for s in os.environ.get("ZOFF_SCHEDULE_SEEDS", "").split(",") if s]

# 51a0203's first bug: a parameter no rank uses, one of odd size (padding), 2 ranks of zero2-offload
NEVER_USED = Case(
    seed=101, world=2, stage=2, opt="cpu", par="none", precision="fp32", overlap=False, accum=1, clip="never",
    widths=(64,), unused="everywhere", bucket=1000, steps=4, drain=True, delay_ms=0.0, slow_writes_ms=0.0,
)  # fmt: skip
# its second: the disk tier, units of several sub-groups, a disk whose writes lag (0-100 ms each), a step that
# walks a unit (a parameter of it unused by every rank) and a next one that speculates it: the read-ahead
# raced the walk's write-backs
SLOW_WRITES = Case(
    seed=102, world=2, stage=2, opt="nvme", par="none", precision="fp32", overlap=False, accum=1, clip="never",
    widths=(12288,), unused="some_steps", bucket=1 << 20, steps=5, drain=True, delay_ms=0.0,
    slow_writes_ms=50.0,
)  # fmt: skip


def _check(reports: list[dict]) -> None:
    failed = [verdict(r) for r in reports if verdict(r)]
    assert not failed, "cases that differ (rerun one: ZOFF_SCHEDULE_SEEDS=<seed> python -m pytest -q -m " \
        "schedules tests/integration/test_schedules.py):\n" + "\n".join(failed)  # fmt: skip
    for r in reports:
        if expects_commits(Case(**{**r["case"], "widths": tuple(r["case"]["widths"])}), r["norms"]):
            assert min(r["committed"]) > 0, f"seed {r['seed']}: nothing committed ({r['case']})"


def test_the_slice_is_bit_for_bit(swap: Path) -> None:
    reports = run_cases(SLICE, swap)
    _check(reports)
    assert sum(min(r["committed"]) for r in reports) > 0
    assert {r["case"]["world"] for r in reports} == {1, 2, 3}


def test_a_parameter_no_rank_uses_commits_the_same_units_on_every_rank(swap: Path) -> None:
    """At 51a0203 rank 0 committed units its peer discarded (rank-local runs against the padding): the
    parameters ended 0.026 from the run without speculation, no error."""
    (report,) = run_cases([NEVER_USED], swap)
    _check([report])
    assert report["committed"][0] == report["committed"][1] > 0


def test_a_speculated_read_never_overtakes_a_write_back(swap: Path) -> None:
    """At 51a0203 the disk tier's speculative read-ahead took a piece from the file while its write-back was in
    flight in another buffer: last step's states, by up to 0.003."""
    (report,) = run_cases([SLOW_WRITES], swap)
    _check([report])
    assert min(report["committed"]) > 0


# each planted fault with cases that expose it (found by running the harness with the fault planted)
CATCHES = {
    "lax_commit": [replace(case_of(5), seed=201, clip="below", drain=True)],
    "read_ahead": [SLOW_WRITES],
    "rank_local": [NEVER_USED],
    "skip_piece": [replace(SLOW_WRITES, slow_writes_ms=0.0, steps=3)],
}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_harness_catches_a_planted_fault(fault: str, swap: Path) -> None:
    reports = run_cases(CATCHES[fault], swap, fault=fault)
    assert any(verdict(r) for r in reports), f"{fault}: the harness saw no difference"


CHUNK = 25  # cases per test of the marker's run: pytest-xdist's workers share the chunks
_MANY = SEEDS or list(range(1000, 1000 + SCHEDULE_CASES))
CHUNKS = [_MANY[i : i + CHUNK] for i in range(0, len(_MANY), CHUNK)]


@pytest.mark.schedules
@pytest.mark.parametrize("seeds", CHUNKS, ids=[f"seeds{c[0]}-{c[-1]}" for c in CHUNKS])
def test_many_schedules_are_bit_for_bit(seeds: list[int], swap: Path) -> None:
    _check(run_cases(seeds, swap))
