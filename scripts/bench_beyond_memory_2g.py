#!/usr/bin/env python
"""bench_beyond_memory.py with the rank's host budget forced to 2 GiB: on this CPU host the model's working
memory (gathered blocks, activations) takes most of it, so every optimizer state of the 3.4B demo streams from
disk (issue 32's "budget forced small" figures). Its own JSON, same table.

    python scripts/bench_beyond_memory_2g.py [bench_beyond_memory.py's flags]
    python scripts/bench_beyond_memory_2g.py --render
"""

from __future__ import annotations

import sys

import benchlib
from bench_beyond_memory import main as bench_main
from beyond_memory_report import render  # noqa: F401  (render_docs.py renders this page region with it)

JSON = benchlib.RESULTS / "bench_beyond_memory_2g.json"
BUDGET = "zero.offload_optimizer.host_budget=2GiB"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [] if "--json" in argv else ["--json", str(JSON)]
    return bench_main([*flags, *argv] if "--render" in argv else [*flags, *argv, BUDGET])


if __name__ == "__main__":
    sys.exit(main())
