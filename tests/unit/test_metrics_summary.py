"""summary.json's throughput is the run's tokens over its time (its first step left out), not a mean of rates."""

from __future__ import annotations

import json
import logging

from zoff.trainer.metrics import MetricsWriter


def test_mean_tokens_per_s_is_total_tokens_over_total_time(tmp_path) -> None:
    w = MetricsWriter(tmp_path, 4, 0, False, logging.getLogger("t"))
    for step, dt in enumerate((30.0, 1.0, 1.0, 8.0), start=1):  # the first: start-up; the last: a slow step
        w.step(
            {"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1000 / dt, "step_time_s": dt},
            step % 2 == 0,
        )
    summary = w.close()
    assert summary["mean_tokens_per_s"] == 3000 / 10.0  # (a mean of the logged rates would say 562.5)
    assert json.loads((tmp_path / "summary.json").read_text())["mean_tokens_per_s"] == 300.0
