#!/usr/bin/env python
"""bench_beyond_memory_dpu.py (the opt-in delayed update: parameters one step stale) with the rank's host
budget forced to 2 GiB, as bench_beyond_memory_2g.py is for the exact step: every optimizer state streams
from disk. Its own JSON, same table.

    python scripts/bench_beyond_memory_dpu_2g.py [bench_beyond_memory.py's flags]
    python scripts/bench_beyond_memory_dpu_2g.py --render
"""

from __future__ import annotations

import sys

import benchlib
from bench_beyond_memory_2g import BUDGET
from bench_beyond_memory_dpu import main as dpu_main
from beyond_memory_report import render  # noqa: F401  (render_docs.py renders this page region with it)

JSON = benchlib.RESULTS / "bench_beyond_memory_dpu_2g.json"

if __name__ == "__main__":
    sys.exit(dpu_main(None, JSON, (BUDGET,)))
