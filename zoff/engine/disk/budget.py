"""The disk tier's host budget (zero.offload_optimizer.host_budget) in bytes per rank: a size, min, or auto (this
host's memory less a margin, split over its ranks). How the tier spends it, what stays in RAM, is the
placement's (placement.disk_split).
"""

from __future__ import annotations

from pathlib import Path

from zoff.config.sections import OffloadOptimizerConfig
from zoff.errors import UserError
from zoff.units import parse_size

# auto keeps max(AUTO_MARGIN_MIN + AUTO_MARGIN_PER_RANK per local rank, AUTO_MARGIN_FRACTION) of the host for
# what the budget does not count: the OS and the page cache of the data (the minimum), the launcher, and per
# rank its interpreter and allocator slack (the 3.4B demo at host_budget=2GiB peaked 0.75 GiB above it). The
# rank's activations, gathered blocks and staging are inside the budget (disk_split's `reserved`). Every byte
# kept back costs a byte read and a byte written per step: 25% (the first margin) left 5.7 GiB of this
# 24 GiB machine idle while the disk was the step's bottleneck.
AUTO_MARGIN_FRACTION, AUTO_MARGIN_MIN, AUTO_MARGIN_PER_RANK = 0.125, 2 << 30, 768 << 20


def mem_total() -> int:
    """This host's MemTotal (/proc/meminfo), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise UserError(
        "/proc/meminfo has no MemTotal: give zero.offload_optimizer.host_budget as a size (zoff estimate: --cpu-memory)"
    )


def host_budget_bytes(oo: OffloadOptimizerConfig, host_bytes: int, local_ranks: int) -> int | None:
    """zero.offload_optimizer.host_budget in bytes per rank: auto is `host_bytes` (a node's memory) less
    max(AUTO_MARGIN_MIN + AUTO_MARGIN_PER_RANK x local_ranks, AUTO_MARGIN_FRACTION of it), split over the
    node's ranks; None for min."""
    text = oo.host_budget.strip().lower()
    if text == "min":
        return None
    if text == "auto":
        ranks = max(1, local_ranks)
        margin = max(AUTO_MARGIN_MIN + ranks * AUTO_MARGIN_PER_RANK, int(AUTO_MARGIN_FRACTION * host_bytes))
        return max(0, host_bytes - margin) // ranks
    return parse_size(oo.host_budget, "zero.offload_optimizer.host_budget", lo=0)
