"""`zoff estimate --time` with exact speculation (zoff/planning/speculated_time.py, step_time.predict): a row that
speculates gets a second step, the one whose clip does not trigger, where the speculated units' bytes and CPU
Adam leave the walk for the last backward; the first stays the step whose clip triggers."""

from __future__ import annotations

import dataclasses

import pytest

from zoff.engine.disk.placement import DiskSplit
from zoff.engine.disk.second_slots import SecondSlots
from zoff.engine.policy import Policy
from zoff.planning.memory import PolicyEstimate
from zoff.planning.speculated_time import speculated_work
from zoff.planning.speculation_costs import Spending
from zoff.planning.step_time import Rates, StepTime, predict

GB = 10**9
SHARD = 10**9  # the rank's trainable parameters
PIECES = [4 * GB, 4 * GB, 4 * GB]  # 12 B per parameter: a third of the shard each, all streamed
SPLIT = DiskSplit(resident=(), pieces=3, grads_on_disk=True)
GRADS = 2 * GB  # the gradient file: 2 B per parameter
PARAMS = 2 * GB  # the parameter shards in the compute dtype
# the last unit speculated: its piece's states (a third of the shard) and its parameter shard's second region
SECOND = SecondSlots(frozenset({2}), frozenset({2}), 4 * GB, PARAMS // 3, candidates=3)


def _pe(spec: Spending, policy: Policy = Policy(3, "nvme", "nvme")) -> PolicyEstimate:
    """zero3-nvme, one micro-batch: forward and backward read the parameter shards twice and write the
    gradient file; the step reads the states and the gradients and writes the states and the shards back."""
    streamed = sum(PIECES)
    read, written = streamed + GRADS + 2 * PARAMS, streamed + GRADS + PARAMS
    return PolicyEstimate(policy, {}, {}, 1, 0, 0, read, written, GRADS, SPLIT, speculation=spec)


def _rates(compute_s: float, adam_ns: float = 1.0, read_gbps: float = 1.0) -> Rates:
    return Rates(compute_s, adam_ns * 1e-9, read_gbps, 2 * read_gbps, ())


def _both(pe: PolicyEstimate, rates: Rates, **kw) -> tuple[StepTime, StepTime]:
    st = predict(pe, PIECES, rates, 1, SHARD, **kw)
    assert st.speculated is not None
    return st, st.speculated


def test_a_row_that_does_not_speculate_has_no_speculated_step() -> None:
    rates = _rates(6.0)
    off = predict(_pe(Spending(split=SPLIT, second=SECOND, on=False)), PIECES, rates, 1, SHARD)
    assert off.speculated is None
    # on, but the disk's room holds no second slot: nothing to commit
    no_room = predict(
        _pe(Spending(split=SPLIT, second=SecondSlots(candidates=3), on=True)), PIECES, rates, 1, SHARD
    )
    assert no_room.speculated is None and no_room == off
    # delay_update never speculates (and its own model has no walk after backward to shorten)
    on = _pe(Spending(split=SPLIT, second=SECOND, on=True))
    assert predict(on, PIECES, rates, 1, SHARD, delayed=True).speculated is None
    # the host tier without second buffers (its host budget min leaves none)
    host = _pe(Spending(on=True), Policy(3, "cpu", "cpu"))
    assert predict(host, PIECES, rates, 1, SHARD).speculated is None


def test_the_speculated_units_bytes_move_from_the_walk_into_backward() -> None:
    """Disk-bound: the walk after backward shrinks by exactly the speculated units' bytes at the disk's
    rates (their states each way, their gradient read once, their new shards written), and backward grows by
    the same, the disk serving both phases' bytes one after the other."""
    pe = _pe(Spending(split=SPLIT, second=SECOND, on=True))
    work = speculated_work(pe, SHARD)
    assert work is not None
    params = SECOND.state_bytes // 12  # the unit's third of the shard
    assert work.params == params == SHARD // 3
    assert work.read == SECOND.state_bytes + GRADS * params // SHARD
    assert work.written == SECOND.state_bytes + SECOND.param_bytes
    moved = work.read / GB + work.written / (2 * GB)
    clipped, unclipped = _both(pe, _rates(1.0))  # fast cores: both phases wait on the disk
    assert clipped.bound == unclipped.bound == "disk / disk"
    assert clipped.optimizer_s - unclipped.optimizer_s == pytest.approx(moved)
    assert unclipped.forward_backward_s - clipped.forward_backward_s == pytest.approx(moved)
    # the same bytes, one disk: the step takes as long either way; the gain is compute hidden under the disk
    assert unclipped.step_s == pytest.approx(clipped.step_s)
    # the overlapped step walks the same rest beside the next forward
    clipped, unclipped = _both(pe, _rates(1.0), overlap=True)
    assert clipped.optimizer_s - unclipped.optimizer_s == pytest.approx(moved)

    # the worker starts with the last backward (two thirds of the compute): a disk idle during the forward
    # does not serve it there (zero2-nvme: backward only writes the gradient file, 1 s of the disk)
    stage2 = PolicyEstimate(
        Policy(2, "nvme"), {}, {}, 1, 0, 0, sum(PIECES) + GRADS, sum(PIECES) + GRADS, GRADS, SPLIT,
        speculation=Spending(split=SPLIT, second=dataclasses.replace(SECOND, param_bytes=0), on=True),
    )  # fmt: skip
    work = speculated_work(stage2, SHARD)
    clipped, unclipped = _both(stage2, _rates(6.0, adam_ns=0.0))
    assert clipped.forward_backward_s == 6.0
    assert unclipped.forward_backward_s == pytest.approx(6.0 / 3 + work.read / GB + work.written / (2 * GB))


def test_the_speculated_adam_takes_backwards_cores_only_on_a_cpu_only_host() -> None:
    """Compute-bound (a fast disk): on a CPU-only host backward grows by the speculated units' CPU Adam and
    the walk loses it; on a GPU host the worker's Adam runs on the host's cores beside the last backward, so
    backward stays as it was; a slow disk bounds backward on either host."""
    pe = _pe(Spending(split=SPLIT, second=SECOND, on=True))
    spec_adam = (SHARD // 3) * 3e-9  # 1 s: shorter than the last backward's 2/3 x 6 s
    fast = _rates(6.0, adam_ns=3.0, read_gbps=100.0)
    clipped, unclipped = _both(pe, fast)
    assert clipped.bound == unclipped.bound == "compute / adam"
    assert unclipped.forward_backward_s == pytest.approx(clipped.forward_backward_s + spec_adam)
    assert clipped.optimizer_s - unclipped.optimizer_s == pytest.approx(spec_adam)
    clipped, unclipped = _both(pe, fast, shared_cores=False)
    assert unclipped.forward_backward_s == pytest.approx(clipped.forward_backward_s)
    assert clipped.optimizer_s - unclipped.optimizer_s == pytest.approx(spec_adam)
    # a slow disk: backward waits on its own bytes (the parameter reads and the gradient landing) and then
    # the worker's, whatever the cores
    slow = _rates(6.0, adam_ns=3.0, read_gbps=1.0)
    work = speculated_work(pe, SHARD)
    own = 2 * PARAMS / GB + GRADS / (2 * GB)  # 5 s: shorter than the compute, so the clipped step's is 6 s
    for shared in (True, False):
        clipped, unclipped = _both(pe, slow, shared_cores=shared)
        assert clipped.forward_backward_s == 6.0 and unclipped.bound.startswith("disk")
        assert unclipped.forward_backward_s == pytest.approx(own + work.read / GB + work.written / (2 * GB))


def test_the_host_tier_moves_only_its_adam() -> None:
    """The host tier's second buffers (12 B per element) say the speculated parameters; no disk bytes."""
    pe = PolicyEstimate(
        Policy(3, "cpu", "cpu"), {}, {}, 1, speculation=Spending(ram=12 * (SHARD // 4), on=True, units=1)
    )
    work = speculated_work(pe, SHARD)
    assert (work.read, work.written, work.params) == (0, 0, SHARD // 4)
    clipped, unclipped = _both(pe, _rates(6.0, adam_ns=4.0), shared_cores=False)
    assert unclipped.forward_backward_s == clipped.forward_backward_s == 6.0
    assert clipped.optimizer_s - unclipped.optimizer_s == pytest.approx(1.0)


def test_zoff_estimate_time_says_both_steps_of_a_row_that_speculates() -> None:
    """The step s column stays the step when the clip triggers; a line gives each speculating row's other
    step, and --json has it as step_time.speculated (None for a row that does not speculate)."""
    from zoff.planning.estimate import _step_json, _timing_note

    rates = _rates(6.0)
    plain = StepTime(6.0, 10.0, "compute / disk")
    steps = {
        Policy(3, "nvme", "nvme"): dataclasses.replace(plain, speculated=StepTime(9.0, 2.0, "disk / disk"))
    }
    lines = _timing_note(rates, steps)
    assert len(lines) == 2 and "when the clip triggers (nothing committed" in lines[1]
    assert lines[1].endswith("zero3-nvme 11.0 s (backward 9.0 s, then 2.0 s)")
    assert len(_timing_note(rates, {Policy(3, "cpu", "cpu"): plain})) == 1
    assert _step_json(steps[Policy(3, "nvme", "nvme")])["speculated"]["step_s"] == 11.0
    assert _step_json(plain)["speculated"] is None
