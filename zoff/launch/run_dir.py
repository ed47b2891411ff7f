"""A run directory is one run (issue 68, item 1).

At 51a0203 a fresh `zoff train` into a directory that held another run truncated that run's metrics.jsonl,
wrote its own checkpoints beside the old ones, and retention (which keeps the highest step numbers) then
deleted the new run's newest checkpoint; `--resume auto` later picked the old run's, of another model. Now:

- a fresh run (no --resume) into a directory holding another run's records (a metrics.jsonl with lines, or
  a step_* checkpoint) refuses in one line before anything is touched, naming `--resume auto` and `--fresh`;
- `--fresh` moves the old run aside (RUN_DIR.old-TIME, and a checkpoint.dir outside it likewise), never
  deletes it, and says where it went;
- `--resume auto` refuses a checkpoint of another model (a parameter's shape differs from this config's)
  before any rank starts, and without --run-dir continues the config's newest run under runs/.

Only the node that owns the directory checks it: a single node, or node rank 0 of a fixed-size multi-node
run. The other nodes share it on purpose (one command on every node, the same --run-dir); an elastic range
has no owner, so nothing is checked there."""

from __future__ import annotations

import time
from pathlib import Path

from torch import nn

from zoff.config import Config
from zoff.errors import UserError

RUNS = Path("runs")  # where a run without --run-dir goes: runs/<config>-<time> (cli.train)


def owns_run_dir(cfg: Config) -> bool:
    """Whether this node's launcher decides about the run directory (above)."""
    lc = cfg.launch
    if lc.rdzv_endpoint is None:
        return True
    return ":" not in lc.nnodes and lc.node_rank == 0


def records_in(run_dir: Path, ckpt_dir: Path) -> str | None:
    """What of another run `run_dir` holds ("metrics.jsonl (11 records), checkpoints up to step 10"), or None."""
    held = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        with open(metrics, "rb") as f:
            lines = sum(1 for line in f if line.strip())
        held.append(f"metrics.jsonl ({lines} record{'s' if lines != 1 else ''})")
    steps = _steps(ckpt_dir)
    if steps:
        held.append(f"checkpoints up to step {max(steps)} in {ckpt_dir}")
    return ", ".join(held) or None


def claim(run_dir: Path, ckpt_dir: Path, fresh: bool) -> None:
    """Before a run that does not resume: refuse a directory holding another run, or with `fresh` move that
    run aside first."""
    held = records_in(run_dir, ckpt_dir)
    if held is None:
        return
    if not fresh:
        raise UserError(
            f"--run-dir: {run_dir} holds another run ({held}); continue it with --resume auto, start over "
            "with --fresh (moves it aside, deletes nothing), or choose another --run-dir"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = [_aside(run_dir, stamp)]
    if ckpt_dir.exists() and not ckpt_dir.resolve().is_relative_to(run_dir.resolve()):
        moved.append(_aside(ckpt_dir, stamp))
    print(f"zoff: --fresh: moved the earlier run aside: {', '.join(map(str, moved))}", flush=True)


def newest_run(config: Path, runs: Path = RUNS) -> Path | None:
    """The newest runs/<config stem>-<time> directory that holds a checkpoint (--resume auto without
    --run-dir), or None. Time stamps sort as text."""
    found = sorted(p for p in runs.glob(f"{config.stem}-*") if p.is_dir() and _steps(p / "checkpoints"))
    return found[-1] if found else None


def check_same_model(checkpoint: Path, model: nn.Module) -> None:
    """A checkpoint whose parameters have other shapes than this config's model (a run of another model in
    the same directory) is one line here, not a traceback in every rank."""
    from zoff.checkpoint.format import read_manifest

    params = read_manifest(checkpoint, verify=False).get("params")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for entry in params if isinstance(params, list) else []:
        names, shape = entry.get("names") or [], entry.get("shape")
        for name in names:
            if name in shapes and isinstance(shape, list) and tuple(shape) != shapes[name]:
                raise UserError(
                    f"--resume: {checkpoint} holds another model ({name} is {list(shape)} there, "
                    f"{list(shapes[name])} in this config); resume it with its own config, or start over "
                    "with --fresh or another --run-dir"
                )


def _steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return [int(p.name[5:]) for p in ckpt_dir.glob("step_*") if p.name[5:].isdigit() and p.is_dir()]


def _aside(path: Path, stamp: str) -> Path:
    target = path.with_name(f"{path.name}.old-{stamp}")
    n = 1
    while target.exists():  # (two --fresh starts in one second)
        n += 1
        target = path.with_name(f"{path.name}.old-{stamp}-{n}")
    try:
        path.rename(target)
    except OSError as e:
        raise UserError(f"--fresh: cannot move {path} aside to {target}: {e.strerror}") from None
    return target
