#!/usr/bin/env python
"""bench_overlap.py on zero3-offload (parameters and optimizer states in host memory, no disk): the overlapped
step's walk is then the CPU Adam alone, run beside the next forward. Its own JSON, same table.

    python scripts/bench_overlap_offload.py [bench_overlap.py's flags]    # 6 layers of the 3.4B demo
    python scripts/bench_overlap_offload.py --render

On this CPU-only host the forward and the CPU Adam share the same two cores, so the overlap can only hide
what neither uses (the step's Python and the host's stalls); on a GPU host the forward runs on the GPU and
the Adam on the cores, which is where the overlap is for (not measured here).
"""

from __future__ import annotations

import sys

import benchlib
from bench_overlap import main as bench_main
from bench_overlap import render  # noqa: F401  (render_docs.py renders this page region with it)

JSON = benchlib.RESULTS / "bench_overlap_offload.json"
# 6 of the demo's 30 layers: every state in this host's RAM (0.69B parameters, 11 GB of model states)
OFFLOAD = ["model.n_layer=6", "zero.offload_optimizer.device=cpu", "zero.offload_param.device=cpu"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [] if "--json" in argv else ["--json", str(JSON)]
    return bench_main([*flags, *argv] if "--render" in argv else [*flags, *argv, *OFFLOAD])


if __name__ == "__main__":
    sys.exit(main())
