"""Faults planted into the engine, in one process (a rank), so the schedule harness can prove it catches them.

Each is a bug speculation had or could have: a commit rule that takes a factor near 1 for 1; the disk tier's
speculative read-ahead without looking for a buffer whose write-back is in flight (and a commit that leaves the
old bytes claimed: the bug of 51a0203); a commit set each rank decides alone (also 51a0203's); a worker that
skips one piece of a unit and says it completed it.
"""

from __future__ import annotations

import contextlib

FAULTS = ("lax_commit", "read_ahead", "rank_local", "skip_piece")


@contextlib.contextmanager
def planted(fault: str | None):
    """The engine with `fault` planted (None: as it is), restored on exit."""
    if fault is None:
        yield
        return
    owner, name, fn = _PLANTS[fault]()
    original = getattr(owner, name)
    setattr(owner, name, fn)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _lax_commit():
    import zoff.engine.zero as zero

    return zero, "may_commit", lambda factor, overflowed: factor >= 0.999 and not overflowed


def _read_ahead():
    from zoff.engine.disk.state_swap import SwappedStates

    @contextlib.contextmanager
    def speculate(self, k, after=None):
        b = self._take(k)
        if after is not None and after not in self.holds and after not in self.resident:
            idle = [
                x for x in range(self.n_buffers) if x != b and x not in self.holds.values() and self._idle(x)
            ]
            if idle:  # (no look for a buffer that holds `after` with its write in flight)
                self._read_into(min(idle, key=lambda x: self.used[x]), after)
        try:
            yield self._views(b, k)
        finally:
            self._current = None
            self.pending[b] = self._write_ranges(b, k, slot=self.where[k] ^ 1)
            self.contents[b] = None

    return SwappedStates, "speculate", speculate


def _rank_local():
    """51a0203's rule: a unit commits where this rank's runs at begin equal its runs for the step, both
    rank-local (the step's leave the padding out once some parameter went without a gradient)."""
    from zoff.engine.speculation import EngineSpeculation

    def commit(self, exact, unused, sums):
        spec = self.speculation
        if spec is None:
            return frozenset()
        spec.last_unclipped = exact
        if not spec.stopped:
            return frozenset()
        step = self.optimizer.step_count + 1
        runs = (
            _old_step_runs(self.plan, self.rank, set(unused), self.skipped_steps, step)
            if unused
            else spec.runs
        )
        done = spec.done - spec.tainted
        units = frozenset(u for u in done if runs[u] == spec.runs[u]) if exact else frozenset()
        self._end_speculation(units)
        spec.record(len(units))
        return units

    return EngineSpeculation, "_commit_speculation", commit


def _old_step_runs(plan, rank, unused, skipped, step):
    from zoff.engine.step.optimizer import slot_runs

    return [slot_runs(plan, u.index, rank, unused, skipped, step) for u in plan.units]


def _skip_piece():
    from zoff.engine.step.optimizer import ShardOptimizer

    def speculate_unit(self, i, grad, scale, lr, unit_runs, on_piece, stop):
        spans = self.states.spans(i)
        if not spans or not all(self.states.speculable(k) for k, _, _ in spans):
            return False
        for j, (k, lo, hi) in enumerate(spans):
            after = spans[j + 1][0] if j + 1 < len(spans) else None
            with self.states.speculate(k, after) as states:
                if j != len(spans) - 1:  # the unit's last piece is never updated
                    self._piece(states, grad, lo, hi, unit_runs, lr, scale, None)
                on_piece(i, lo, states[0])
        return True

    return ShardOptimizer, "speculate_unit", speculate_unit


_PLANTS = {"lax_commit": _lax_commit, "read_ahead": _read_ahead, "rank_local": _rank_local,
           "skip_piece": _skip_piece}  # fmt: skip
