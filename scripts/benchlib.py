"""What the benchmark scripts share: gloo ranks in fresh processes, the benchmark GPT's config, the
PASS/MISS targets table, the results JSON's provenance (date, commit, machine) with the markdown helpers
their render() functions build tables from, and what a benchmark computes in on a CPU without fast 16-bit
kernels (cpu_precision_plan). The scripts import the installed zoff (`pip install -e .` or a wheel), not
tests/."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from zoff.config import Config, config_from_dict
from zoff.host.kernels import compute_precision, slow_dtype


def _rank_entry(rank: int, world: int, port: int, fn, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # each variant sets its own thread count on purpose
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> list:
    """fn(rank, world, *args) on `world` fresh processes joined over gloo; each rank's return value."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_entry, args=(world, port, fn, args, out), nprocs=world, start_method="spawn")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def gpt_config(args: argparse.Namespace, zero: dict, train: dict) -> Config:
    """The builtin GPT sized by --layers/--d-model/--seq-len/--batch, on synthetic data (64-wide heads)."""
    return config_from_dict(
        {
            "model": {
                "name": "gpt",
                "n_layer": args.layers,
                "n_head": max(1, args.d_model // 64),
                "d_model": args.d_model,
                "seq_len": args.seq_len,
            },
            "data": {"name": "synthetic", "seq_len": args.seq_len, "batch_size": args.batch},
            "zero": zero,
            "train": train,
        }
    )


def print_targets(con: Console, title: str, targets: list[dict], digits: int = 2) -> None:
    """One row per {target, value, limit, result[, op]}; op is "<=" (the default) or ">="; PASS green, MISS red."""
    tab = Table(title=title)
    for col in ("target", "value", "limit", "result"):
        tab.add_column(col)
    for row in targets:
        style = {"PASS": "green", "MISS": "red"}.get(row["result"], "dim")
        tab.add_row(
            row["target"],
            f"{row['value']:.{digits}f}",
            f"{row.get('op', '<=')} {row['limit']:.{digits}f}",
            f"[{style}]{row['result']}[/]",
        )
    con.print(tab)


# ------------------------------------------------------------- 16-bit compute on a CPU without its kernels
# Without AVX512 torch computes bf16/fp16 matmuls on the CPU with a reference kernel, ~100x fp32's time
# (zoff.host.kernels): a benchmark that computes so runs for hours, silently. Each one that computes in a
# 16-bit dtype on the CPU asks cpu_precision_plan first: it computes in fp32 instead (the trainer's own
# train.cpu_precision=fp32, added to every run it measures, its floor's included, and recorded in the JSON
# and the rendered table), or refuses in one line; NATIVE_FLAG keeps the 16-bit path on purpose.
NATIVE_FLAG = "--native-precision"
SWITCH = "train.cpu_precision=fp32"


@dataclass(frozen=True)
class CpuPrecision:
    """What a benchmark computes in on this host's CPU: `configured` (train.precision) and `computed`, the
    configured dtype's matmul path where it is slow here (MatmulPath.describe(), else None), and the
    overrides the script adds to every run it measures to compute so."""

    configured: str
    computed: str
    matmul: str | None = None
    overrides: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """The results JSON's "cpu_precision" (precision_note renders it)."""
        return {"configured": self.configured, "computed": self.computed, "matmul": self.matmul}


def native_precision_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        NATIVE_FLAG, action="store_true",
        help="compute in the configured 16-bit dtype on the CPU even where this host has no fast kernel for "
        "it (~100x fp32's time: hours); by default such a run computes in fp32, or the script refuses",
    )  # fmt: skip


def cpu_precision_plan(
    who: str, precision: str, native: bool = False, *, refuse: str | None = None,
    cpu_precision: str = "native", switch: str | None = SWITCH, on_cpu: bool | None = None,
) -> CpuPrecision:  # fmt: skip
    """What `who` computes in on this host's CPU, where the run is configured with train.precision
    `precision` and train.cpu_precision `cpu_precision` (on_cpu: default, no CUDA device here).

    Where the configured 16-bit dtype is slow here (zoff.host.kernels.slow_dtype) and the run would compute
    in it: with `native` (NATIVE_FLAG) it does, on purpose; with `refuse` (what to do instead, e.g. "pass
    --precision fp32") one line on stderr names the factor, `refuse` and NATIVE_FLAG, and the script exits
    2; else it computes in fp32, through the override `switch` (None: the script computes itself, in
    .computed)."""
    on_cpu = not torch.cuda.is_available() if on_cpu is None else on_cpu
    computed, _ = compute_precision(precision, cpu_precision, on_cpu)
    slow = slow_dtype(precision) if on_cpu else None
    if slow is None or computed != precision or native:
        return CpuPrecision(precision, computed, slow.describe() if slow else None)
    if refuse is not None:
        print(
            f"{who}: {slow.describe()}: a {precision} run here takes about {slow.factor:.0f}x its fp32 time "
            f"(hours); {refuse}, or {NATIVE_FLAG} to run it in {precision} anyway",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return CpuPrecision(precision, "fp32", slow.describe(), (switch,) if switch else ())


def computed_in(data: dict) -> str:
    """The words after a configured precision the run did not compute in (" (computed in fp32)"), else ""."""
    cp = data.get("cpu_precision") or {}
    return f" (computed in {cp['computed']})" if cp and cp["computed"] != cp["configured"] else ""


def precision_note(data: dict) -> str:
    """The rendered sentence on a results JSON's "cpu_precision": a run computed in fp32 rather than its
    configured 16-bit dtype, or in that dtype on a slow kernel on purpose; "" where there is nothing to say
    (and for JSONs written before the field existed)."""
    cp = data.get("cpu_precision") or {}
    conf, comp, matmul = cp.get("configured"), cp.get("computed"), cp.get("matmul")
    if conf and comp and comp != conf:
        if not matmul:  # the config's own train.cpu_precision
            return f"Computed in {comp} on the CPU, not {conf} (train.cpu_precision). "
        return (
            f"Computed in {comp} on the CPU, not {conf}: this host has no fast {conf} kernel ({matmul}); "
            f"{NATIVE_FLAG} keeps {conf}. "
        )
    if matmul:
        return f"Computed in {conf} on a slow kernel, on purpose ({NATIVE_FLAG}): {matmul}. "
    return ""


# ------------------------------------------------------------------------------- results JSON (docs/results/)
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"  # each script's JSON: the docs' tables are rendered from these files


def git_commit() -> str:
    """HEAD's short hash, "+dirty" when tracked files differ from it. Untracked files are left out (other
    sessions' new docs would mark every run dirty, and nothing measured imports an untracked file), and so are
    docs/ and the markdown pages: each benchmark writes its JSON there, which would mark the next one dirty."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs", ":(exclude)*.md"
        )
    except OSError:  # no git on this machine
        return "unknown"
    return (head or "unknown") + ("+dirty" if head and dirty else "")


def machine() -> dict:
    """CPU model, cores, RAM, OS, torch and Python: what a reader needs to weigh a timing."""
    cpu = platform.processor() or "unknown"
    try:
        models = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
        cpu = models[0].split(":", 1)[1].strip() if models else cpu
    except OSError:
        pass
    try:
        ram: int | str = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def provenance() -> dict:
    """The top-level fields every results JSON carries: date (ISO 8601, UTC), commit and machine."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"date": now, "commit": git_commit(), "machine": machine()}


def command_line(ap: argparse.ArgumentParser, a: argparse.Namespace, script: str) -> str:
    """The command that reproduces a run: the script with every option that differs from its default (the
    output path left out: it does not change what is measured, and a preset's own JSON follows from its
    --preset, which is recorded)."""
    words = ["python", f"scripts/{script}.py"]
    for act in ap._actions:
        value = getattr(a, act.dest, None)
        if act.dest in ("help", "out", "render") or value == act.default:
            continue
        if not act.option_strings:
            words += [str(v) for v in value] if isinstance(value, list) else [str(value)]
        elif act.nargs == 0:
            words.append(act.option_strings[0])
        else:
            words += [act.option_strings[0], str(value)]
    return " ".join(words)


def output_args(ap: argparse.ArgumentParser, json_path: Path) -> None:
    """--json (where the results go; the docs render from the default) and --render (only print the table)."""
    ap.add_argument("--json", type=Path, default=json_path, dest="out")
    ap.add_argument("--render", action="store_true", help="only print the table from --json")


@dataclass(frozen=True)
class Preset:
    """One setup of a benchmark script, run on its own (not one of the variants a benchmark compares within a
    job): the overrides it adds after the command line's, and the JSON it writes, which a page renders in the
    region `<!-- render: SCRIPT --preset NAME -->` (scripts/render_docs.py)."""

    json: Path
    overrides: tuple[str, ...] = ()


def preset_args(ap: argparse.ArgumentParser, presets: dict[str, Preset]) -> None:
    """--preset (one of `presets`, "default" first), --json (default: the preset's own JSON) and --render;
    after parse_args, resolve_output(a, presets) fills in the preset's JSON."""
    what = "which setup: its overrides and its own JSON under docs/results/"
    ap.add_argument("--preset", choices=list(presets), default="default", help=what)
    ap.add_argument("--json", type=Path, default=None, dest="out", help="default: the preset's JSON")
    ap.add_argument("--render", action="store_true", help="only print the table from the JSON")


def resolve_output(a: argparse.Namespace, presets: dict[str, Preset]) -> Preset:
    """The chosen preset; a.out becomes its JSON unless --json named another."""
    preset = presets[a.preset]
    a.out = a.out or preset.json
    return preset


def step_records(run_dir: Path) -> list[dict]:
    """A `zoff train` run's per-step records (metrics.jsonl, events left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_time_s" in r and "event" not in r]


def train_records(
    config: Path, overrides: list[str], who: str, stdout: list[str] | None = None, **run_kwargs
) -> list[dict]:
    """`zoff train config overrides` in a temporary run folder (subprocess.run's `cwd`/`env` in run_kwargs):
    its per-step records; a failed run raises SystemExit naming `who` with the run's last output. `stdout`, if
    given, receives the run's output lines (its start-up plan: what it computed in)."""
    return train_run(config, overrides, who, stdout, **run_kwargs)[0]


def train_run(
    config: Path, overrides: list[str], who: str, stdout: list[str] | None = None, **run_kwargs
) -> tuple[list[dict], dict]:
    """train_records, and the run's summary.json (its peak RSS per rank, among others)."""
    with tempfile.TemporaryDirectory(prefix="zoff-bench-") as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "zoff", "train", str(config), *overrides, "--run-dir", str(run)]
        p = subprocess.run(cmd, capture_output=True, text=True, **run_kwargs)
        if p.returncode != 0:
            raise SystemExit(f"{who}: {' '.join(cmd)} failed:\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
        if stdout is not None:
            stdout.extend(p.stdout.splitlines())
        return step_records(run), json.loads((run / "summary.json").read_text())


def interleaved_rounds(
    names: tuple[str, str], rounds: int, measure: Callable[[str], dict], ratio_key: str = "step_s"
) -> list[dict]:
    """`rounds` rounds of two variants measured in alternating order (A B, B A, ...: this host's memory
    bandwidth switches modes and other work shares it), each round with the ratio of the second variant's
    `ratio_key` to the first's; `measure(name)` runs one variant."""
    out = []
    for i in range(rounds):
        order = names if i % 2 == 0 else names[::-1]
        t = {name: measure(name) for name in order}
        out.append({"round": i + 1, "order": " then ".join(order), **t,
                    "ratio": t[names[1]][ratio_key] / t[names[0]][ratio_key]})  # fmt: skip
        print(f"round {i + 1}: " + ", ".join(f"{n} {t[n][ratio_key]:.2f} s" for n in names), flush=True)
    return out


def interleaved_result(
    ap: argparse.ArgumentParser, a: argparse.Namespace, script: str, overrides: list[str], cpu: CpuPrecision,
    rounds: list[dict], **extra,
) -> dict:  # fmt: skip
    """The JSON of an off/on benchmark (interleaved_rounds of variants named off and on): provenance, the
    command, the config, the overrides, `extra`, the rounds, the median ratio and whether every run's losses
    were the same."""
    losses = [r[v]["losses"] for r in rounds for v in ("off", "on")]
    config = a.config.resolve()
    return {
        **provenance(), "command": command_line(ap, a, script),
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(a.config),
        "steps": a.steps, "overrides": overrides, **extra, "cpu_precision": cpu.to_json(), "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "same_losses": all(x == losses[0] for x in losses),
    }  # fmt: skip


def write_result(out: Path, data: dict, render: Callable[[dict], str]) -> int:
    """The JSON written, the table printed."""
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(render(data), end="")
    return 0


def print_rendered(path: Path, render: Callable[[dict], str]) -> int:
    """--render: the table(s) from the JSON, without measuring; 2 when there is no JSON yet."""
    if not path.is_file():
        print(f"{path}: no results yet (run the script without --render to measure)")
        return 2
    sys.stdout.write(render(json.loads(path.read_text())))
    return 0


# ------------------------------------------------------------------------------------------ markdown (pure)
def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def md_targets(targets: list[dict], digits: int = 2) -> str:
    """print_targets' table in markdown; a row's optional "range" (per-round min, max) gets its own column."""
    ranged = any("range" in t for t in targets)
    header = ["target", "value"] + (["per-round range"] if ranged else []) + ["limit", "result"]
    rows = []
    for t in targets:
        span = [f"{t['range'][0]:.{digits}f}-{t['range'][1]:.{digits}f}"] if "range" in t else [""]
        rows.append(
            [t["target"].strip(), f"{t['value']:.{digits}f}", *(span if ranged else [])]
            + [f"{t.get('op', '<=')} {t['limit']:.{digits}f}", t["result"]]
        )
    return md_table(header, rows)


def _gib(n: object) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, (int, float)) else str(n)


def machine_summary(m: dict) -> str:
    """One line from machine(); a field the JSON does not know is left out ("an unrecorded machine": none known)."""
    parts = [
        m.get("gpu", ""),  # (the GPU scripts' JSON names it)
        m.get("cpu", "unknown"),
        f"{m['cores']} cores" if isinstance(m.get("cores"), int) else "",
        f"{_gib(m['ram_bytes'])} RAM" if isinstance(m.get("ram_bytes"), (int, float)) else "",
        m.get("os", "unknown"),
        f"torch {m['torch']}" if m.get("torch", "unknown") != "unknown" else "",
    ]
    known = [p for p in parts if p and p != "unknown"]
    return ", ".join(known) if known else "an unrecorded machine"


def measured_line(data: dict, script: str) -> str:
    """The line that ends every rendered table: when, at which commit, on what, and the command."""
    date = data.get("date") or "unknown"
    try:
        when = datetime.datetime.fromisoformat(date).strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        when = date
    cmd = data.get("command") or f"python scripts/{script}.py"
    return f"{precision_note(data)}Measured {when} at commit {data.get('commit') or 'unknown'} on {machine_summary(data['machine'])}; `{cmd}`\n"
