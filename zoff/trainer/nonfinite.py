"""What the loop does with a step the engine skipped because a loss or a gradient was non-finite.

The engine never applies such a step, on any rank (zero.py: every rank learns it from the step's one
all-reduce, each rank's flag in its own slot). This part says so in one line, naming the step and the ranks,
keeps the count the records and the summary show, and ends a run that only skips: `train.max_nonfinite_steps`
in a row stop it (without it, a run on a broken batch stream or a diverged model would go on logging NaN until
max_steps, its checkpoints saying nothing new). fp16's overflows are skipped and counted too, but while its
scaler can still bring the scale down they do not count toward the stop (a non-finite loss, or an overflow at
the scale's floor of 1, does). Nothing here chooses what is applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

STOP_FILE = "nonfinite_stop.json"  # the ranks' word to the launcher: why the run ended before max_steps


@dataclass
class NonFinite:
    limit: int  # train.max_nonfinite_steps
    fp16: bool
    streak: list[int] = field(default_factory=list)  # the steps skipped in a row, up to the last one

    def after(self, step: int, result) -> str | None:
        """After step `step` (1-based; `result`: the engine's StepResult): the line to print where it was
        skipped (None where it was applied)."""
        if result.stepped:
            self.streak = []
            return None
        if not result.scale_lowered:  # (fp16's overflow with room to scale down: it may cure itself)
            self.streak.append(step)
        where = ", ".join(map(str, result.nonfinite_ranks))
        if self.fp16 and result.scale_lowered:
            what = f"fp16 overflow in the gradients on rank(s) {where} (the loss scale comes down)"
        elif result.nonfinite == "loss":
            what = f"a non-finite loss on rank(s) {where}"
        else:  # (every rank's shard of a reduced gradient that held a NaN or inf)
            what = f"a non-finite gradient, in the shards of rank(s) {where}"
        return (
            f"zoff: step {step} skipped: {what}; parameters, optimizer states and the step count are as "
            f"after step {step - 1}"
        )

    def must_stop(self) -> bool:
        return len(self.streak) >= self.limit

    @property
    def in_streak(self) -> bool:
        """The last step was skipped (and counts toward the stop): no periodic checkpoint now, which would
        hold the values of the step before the streak under a later step's name and push older ones out."""
        return bool(self.streak)

    def stop_reason(self) -> str:
        first, last = self.streak[0], self.streak[-1]
        return (
            f"{len(self.streak)} steps in a row ({first}-{last}) had a non-finite loss or gradient "
            f"(train.max_nonfinite_steps = {self.limit}); none of them was applied"
        )


def note_stop(run_dir: Path, step: int, reason: str) -> None:
    """Rank 0's record for the launcher (cli.py reads it once the ranks are done)."""
    (run_dir / STOP_FILE).write_text(json.dumps({"step": step, "reason": reason}) + "\n")


def clear_stop(run_dir: Path) -> None:
    """Before the ranks start: a record left by an earlier launch (one that later failed or was stopped) must
    not be read as this one's."""
    (run_dir / STOP_FILE).unlink(missing_ok=True)


def recorded_stop(run_dir: Path) -> dict | None:
    """The stop rank 0 recorded in `run_dir`, and forgets it (a resumed run starts without one)."""
    path = run_dir / STOP_FILE
    try:
        with path.open("rb") as f:
            data = json.loads(f.read(1 << 16))  # (a few hundred bytes of its own; never more read)
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return data if isinstance(data, dict) and isinstance(data.get("reason"), str) else None
