"""Which ranks are not answering when a collective fails: the ranks that failed in it report in through the
rendezvous store and wait a few seconds for each other (collectives.Comm._explain names the rest)."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

_REPORT_WINDOW_S = 5.0  # how long the ranks that failed in one collective wait for each other's reports


def not_answering(rank: int, world: int, kind: str) -> str:
    """The ranks that did not report this failure, as text ("unknown" when the store cannot be read).

    Every healthy rank times out in the same collective at about the same time and reports in through
    the rendezvous store; the ranks that do not report within a few seconds are the dead or stuck ones.
    Then each rank says it has read the reports and waits (as long again, at most) until every rank that
    reported has too: the rank that hosts the store (rank 0 under a plain init_process_group) takes it
    down when it raises and leaves, and a peer that reported a moment later would still be reading.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        tag = f"zoff/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.set(f"{tag}/{rank}", kind)
        missing = _missing_keys(store, tag, range(world))
    except Exception:  # noqa: BLE001 - diagnosis is best effort; the original error still surfaces
        return "unknown"
    try:
        store.set(f"{tag}/read/{rank}", kind)
        _missing_keys(store, f"{tag}/read", [r for r in range(world) if r not in missing])
    except Exception:  # noqa: BLE001 - a store already gone: every rank that needed it has read
        pass
    return ", ".join(map(str, missing)) or "none (all ranks failed here)"


def _missing_keys(store: dist.Store, prefix: str, ranks) -> list[int]:
    """The ranks whose key `prefix/rank` is still absent after _REPORT_WINDOW_S (at once when none is)."""
    deadline = time.monotonic() + _REPORT_WINDOW_S
    missing = list(ranks)
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
        if missing:
            time.sleep(0.2)
    return missing
