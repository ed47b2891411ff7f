#!/usr/bin/env python
"""bench_beyond_memory.py under the opt-in delayed update (zero.offload_optimizer.delay_update, ZeRO-Offload's
DPU on the disk tier: parameters one step stale, so NOT the exact numbers of the other tables): each step's
optimizer walk runs beside the next step's forward and backward, reading one gradient file while backward
writes the other and writing the new parameter shards into the parameter file's other slot (issue 32's
"a mode that changes the math", off in every shipped recipe). Its own JSON, same table.

    python scripts/bench_beyond_memory_dpu.py [bench_beyond_memory.py's flags]     # the default host budget
    python scripts/bench_beyond_memory_dpu.py --render
    (scripts/bench_beyond_memory_dpu_2g.py: the same with the host budget forced to 2 GiB)
"""

from __future__ import annotations

import sys

import benchlib
from bench_beyond_memory import main as bench_main
from beyond_memory_report import render  # noqa: F401  (render_docs.py renders this page region with it)

JSON = benchlib.RESULTS / "bench_beyond_memory_dpu.json"
DPU = ["zero.offload_optimizer.overlap_step=false", "zero.offload_optimizer.delay_update=true"]


def main(argv: list[str] | None = None, json_path=JSON, extra: tuple[str, ...] = ()) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [] if "--json" in argv else ["--json", str(json_path)]
    return bench_main([*flags, *argv] if "--render" in argv else [*flags, *argv, *DPU, *extra])


if __name__ == "__main__":
    sys.exit(main())
