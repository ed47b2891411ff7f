"""`zoff` command line: train, validate, estimate, convert, doctor. Bad input: one line on stderr, exit 2."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer

from zoff.config import dump_yaml, load_config
from zoff.errors import UserError
from zoff.trainer import regather, run_end


def _examples(*lines: str) -> str:
    """A command's help epilog: example command lines, kept as typed (click's \\b: no rewrapping)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


app = typer.Typer(
    epilog=_examples(
        "zoff train configs/quickstart.yaml",
        "zoff estimate configs/gpt-7b.yaml --gpus-per-node 1 --gpu-memory 24GiB --suggest",
        "zoff convert runs/qs/checkpoints out --format hf",
    ),
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Train PyTorch models with ZeRO partitioning and CPU or NVMe offload, from a YAML config.",
)

OVERRIDES = typer.Argument(None, help="Config overrides KEY.PATH=VALUE, e.g. train.max_steps=50 zero.stage=2")


def _flag_overrides(**flags: object) -> list[str]:
    """CLI flags are shorthands for launch.* keys, so they are validated exactly like the config."""
    return [f"launch.{k}={v}" for k, v in flags.items() if v is not None]


@app.command(
    epilog=_examples(
        "zoff train configs/quickstart.yaml",
        "zoff train configs/gpt-7b.yaml zero=zero3-offload train.max_steps=100 --nproc-per-node 8",
        "zoff train configs/quickstart.yaml --run-dir runs/qs --resume auto",
    )
)
def train(
    config: Path = typer.Argument(..., help="YAML config (see configs/)"),
    overrides: list[str] = OVERRIDES,
    nproc_per_node: int = typer.Option(
        None, "--nproc-per-node", help="Ranks on this node (launch.nproc_per_node)"
    ),
    nnodes: str = typer.Option(None, "--nnodes", help="Nodes: N or MIN:MAX (launch.nnodes)"),
    node_rank: int = typer.Option(None, "--node-rank", help="This node's rank (launch.node_rank)"),
    rdzv_endpoint: str = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous"),
    max_restarts: int = typer.Option(None, "--max-restarts", help="Elastic restarts on failure"),
    run_dir: Path = typer.Option(None, "--run-dir", help="Run directory (default runs/<config>-<time>)"),
    resume: str = typer.Option(None, "--resume", help="auto or a checkpoint path"),
    fresh: bool = typer.Option(
        False,
        "--fresh",
        help="Start over in a --run-dir holding another run: move it aside (RUN_DIR.old-TIME)",
    ),
) -> None:
    """Train a model on this node's ranks (and others joining the rendezvous)."""
    extra = _flag_overrides(
        nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
    )  # fmt: skip
    cfg = load_config(config, list(overrides or []) + extra)
    from zoff.launch import rank_server

    rank_server.start(cfg.launch)  # its imports beside this process's own (torch's, the pre-flight)
    from zoff.files.hub import pin as pin_hub_ids
    from zoff.launch.elastic import check_torch
    from zoff.launch.network import node_address
    from zoff.launch.preflight import check_before_launch

    check_torch()
    node_address(cfg.launch)  # the interface and the endpoint resolve, before anything starts
    cfg = pin_hub_ids(cfg)  # Hub models and tokenizers fetched once here, their commit pinned for the ranks
    model = check_before_launch(cfg)
    if cfg.zero.auto:
        from zoff.planning.estimate import choose_policy  # torch-free start for the other commands

        cfg, why = choose_policy(cfg)
        print(why, flush=True)
    out_dir = Path(run_dir or cfg.log.run_dir) if (run_dir or cfg.log.run_dir) else None
    out_dir, resume = _claim_run_dir(config, cfg, model, out_dir, resume, fresh)
    from zoff.planning.disk_room import check_checkpoint_room

    # room for a checkpoint: a save that cannot fit would fail hours in, with nothing saved
    check_checkpoint_room(
        cfg, model, Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"
    )
    out = _make_run_dir(out_dir)
    (out / "config.yaml").write_text(dump_yaml(cfg))
    print(f"zoff: run directory {out}", flush=True)
    _launch_until_done(cfg, out, resume)


def _launch_until_done(cfg, out: Path, resume: str | None) -> None:
    """Launch the ranks, again from the last checkpoint where a regather restart is due (regather.py); a
    failure or a stop ends the command with the lines that say what is on disk and how to go on."""
    from zoff.checkpoint.status import latest_on_disk
    from zoff.launch.elastic import Preempted, WorkerFailed, launch

    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    before = latest_on_disk(ckpt_dir)  # what a stop or failure is compared with: saved by this run or not
    while True:
        try:
            _launch_once(launch, cfg, out, resume, ckpt_dir, before)
            return
        except WorkerFailed as e:
            _ended_by_disk_error(out, ckpt_dir, before)
            again = regather.restart_config(cfg, out)
            if again is None:
                print(
                    f"zoff: training failed: {e}\nzoff: per-rank logs are in {out / 'logs'}", file=sys.stderr
                )
                print(
                    run_end.failure_line(ckpt_dir, before) + f"\n  {run_end.resume_command(out)}",
                    file=sys.stderr,
                )
                raise typer.Exit(1) from None
            print(run_end.regather_lines(cfg, again, out, ckpt_dir), file=sys.stderr, flush=True)
            cfg, resume = again, "auto"
            (out / "config.yaml").write_text(dump_yaml(cfg))
        except Preempted as e:
            print(
                run_end.stop_line(e.signal, e.aborted_by, cfg, ckpt_dir, before)
                + f"\n  {run_end.resume_command(out)}",
                file=sys.stderr,
            )
            raise typer.Exit(e.exit_code) from None


def _claim_run_dir(config: Path, cfg, model, out_dir: Path | None, resume: str | None, fresh: bool):
    """The run directory and the checkpoint to resume from, checked before anything starts
    (launch/run_dir.py): a directory holding another run is refused (or, with --fresh, moved aside), a
    checkpoint of another model is refused, and --resume auto without --run-dir takes the config's newest run."""
    from zoff.launch import run_dir as rd
    from zoff.launch.preflight import check_resume

    asked = resume
    if fresh and resume is not None:
        raise UserError("--fresh: starts over; it cannot be combined with --resume")
    if resume == "auto" and out_dir is None and cfg.checkpoint.dir is None:
        out_dir = rd.newest_run(config)
        if out_dir is None:
            raise UserError(
                f"--resume auto: no run of {config.name} under {rd.RUNS}/ holds a checkpoint; give its --run-dir"
            )
        print(f"zoff: --resume auto: continuing {out_dir} (the newest run of {config.name} under {rd.RUNS}/)")
    if resume is not None:
        resume = check_resume(resume, cfg, out_dir)
        if resume is not None:
            rd.check_same_model(Path(resume), model)
    if out_dir is None:
        out_dir = rd.RUNS / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"
    if asked is None and rd.owns_run_dir(cfg):  # (--resume auto with no checkpoint yet: the same run again)
        rd.claim(out_dir, ckpt_dir, fresh)
    return out_dir, resume


def _launch_once(launch, cfg, out: Path, resume: str | None, ckpt_dir: Path, before) -> None:
    """One launch of the ranks; where they ended the run for non-finite steps, say so and exit 1."""
    from zoff.trainer import disk_error
    from zoff.trainer.nonfinite import clear_stop

    clear_stop(out)  # (a record an earlier launch left, one that then failed or was stopped, is not ours)
    disk_error.clear(out)
    launch(cfg, out, resume)
    _stopped_for_nonfinite(out, ckpt_dir, before)


def _stopped_for_nonfinite(out: Path, ckpt_dir: Path, before) -> None:
    """Where the ranks ended the run for train.max_nonfinite_steps (trainer/nonfinite.py): why, the checkpoint
    on disk (every one holds finite values: no skipped step was applied) and the command that resumes; exit 1."""
    from zoff.trainer.nonfinite import recorded_stop

    stop = recorded_stop(out)
    if stop is None:
        return
    print(
        f"zoff: stopped at step {stop.get('step')}: {stop['reason']}\n"
        + run_end.failure_line(ckpt_dir, before)
        + f"\n  {run_end.resume_command(out)}",
        file=sys.stderr,
    )
    raise typer.Exit(1)


def _ended_by_disk_error(out: Path, ckpt_dir: Path, before) -> None:
    """Where a rank met a disk's I/O error (trainer/disk_error.py): one line naming the file, the error and the
    checkpoint on disk, the command that resumes; exit 1 (the traceback is in the rank's logs)."""
    from zoff.trainer import disk_error

    error = disk_error.take(out)
    if error is not None:
        line = run_end.disk_error_line(error, ckpt_dir, before)
        print(f"{line}\n  {run_end.resume_command(out)}", file=sys.stderr)
        raise typer.Exit(1)


@app.command(
    epilog=_examples(
        "zoff validate configs/quickstart.yaml",
        "zoff validate configs/gpt-7b.yaml zero=zero3-nvme zero.offload_optimizer.nvme_path=/mnt/nvme",
        "zoff validate --explain zero.offload_optimizer.host_budget",
    )
)
def validate(
    config: Path = typer.Argument(None, help="YAML config"),
    overrides: list[str] = OVERRIDES,
    explain: str = typer.Option(
        None, "--explain", help="Print a key's (or a section's) type, default, range and meaning, and exit"
    ),
) -> None:
    """Print the fully resolved config (recipes expanded, defaults filled in) and exit."""
    if explain is not None:
        from zoff.config.reference import explain as explain_key

        sys.stdout.write(explain_key(explain))
        return
    if config is None:
        raise UserError("zoff validate: a CONFIG file is needed (or --explain KEY)")
    from zoff.files.hub import pin as pin_hub_ids
    from zoff.launch.preflight import check_before_launch

    # Hub ids resolved to their commit (config files only: a 70B's weights are not fetched to print a config)
    cfg = pin_hub_ids(load_config(config, overrides or []), weights=False)
    check_before_launch(cfg)
    sys.stdout.write(dump_yaml(cfg))


@app.command(
    epilog=_examples(
        "zoff estimate configs/gpt-7b.yaml --gpus-per-node 1 --gpu-memory 24GiB --suggest --write 7b.yaml",
        "zoff estimate configs/gpt-7b.yaml --max-model --disk 4TB",
        "zoff estimate configs/gpt-7b.yaml --max-context --gpus-per-node 1 --gpu-memory 24GiB data.batch_size=1",
    )
)
def estimate(
    config: Path = typer.Argument(..., help="YAML config"),
    overrides: list[str] = OVERRIDES,
    gpus_per_node: str = typer.Option(None, "--gpus-per-node", help="GPUs per node (launch.nproc_per_node)"),
    nodes: str = typer.Option(None, "--nodes", help="Nodes (launch.nnodes; MIN of MIN:MAX)"),
    gpu_memory: str = typer.Option(
        None, "--gpu-memory", help="Memory per GPU, e.g. 80GB (default: detected)"
    ),
    cpu_memory: str = typer.Option(None, "--cpu-memory", help="CPU memory per node (default: MemTotal)"),
    as_json: bool = typer.Option(False, "--json", help="Print the numbers as JSON"),
    suggest: bool = typer.Option(False, "--suggest", help="Name the fastest policy that fits, and why"),
    max_model: bool = typer.Option(
        False, "--max-model", help="Per policy, the largest of a ladder of GPT shapes (125M..405B) that fits"
    ),
    max_context: bool = typer.Option(
        False,
        "--max-context",
        help="Per policy, the longest context (1K..32M tokens) the config's model fits",
    ),
    disk: str = typer.Option(
        None, "--disk", help="Disk tier per node for swap files, e.g. 4TB (default: free space at nvme_path)"
    ),
    timed: bool = typer.Option(
        False, "--time", help="Also the step time of the offload policies, from rates probed on this box"
    ),
    compute_s: str = typer.Option(
        None, "--compute-s", help="--time with this forward+backward s/micro-batch"
    ),
    write: Path = typer.Option(
        None, "--write", help="With --suggest: the suggested config, resolved, into this new YAML file"
    ),
) -> None:
    """Memory needs per GPU and per CPU node for every ZeRO stage and offload choice, activations included."""
    from zoff.planning.estimate import run_cli

    # Counts and sizes arrive as text so that bad values get zoff's one-line error rather than click's usage block.
    run_cli(
        config, list(overrides or []), gpus_per_node, nodes, gpu_memory, cpu_memory, as_json, suggest,
        max_model=max_model, disk=disk, timed=timed, compute_s=compute_s, max_context=max_context, write=write,
    )  # fmt: skip


@app.command(
    epilog=_examples(
        "zoff convert runs/qs/checkpoints model.safetensors",
        "zoff convert runs/llama/checkpoints hf-out --format hf --dtype bf16",
        "zoff convert runs/lora/checkpoints adapter --format peft",
    )
)
def convert(
    checkpoint: Path = typer.Argument(
        ..., help="A checkpoint folder (step_*) or a checkpoint dir (its latest)"
    ),
    out: Path = typer.Argument(..., help="Output file, or folder when --max-shard-size splits it"),
    fmt: str = typer.Option(
        "safetensors",
        "--format",
        help="safetensors, pt, hf (a Hugging Face model folder; hf: models) or peft (a model.lora run's "
        "adapters as a folder for peft's PeftModel.from_pretrained)",
    ),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16 (floating tensors only)"),
    max_shard_size: str = typer.Option(
        None, "--max-shard-size", help="Split into files of at most SIZE (e.g. 2GB)"
    ),
    merge: bool = typer.Option(
        False,
        "--merge",
        help="A model.lora run: merge the adapters into the base weights (W + alpha/r B A) and write the "
        "plain model (with --format hf: a Hugging Face folder)",
    ),
    base: Path = typer.Option(
        None,
        "--base",
        help="A run started from model.path whose base folder moved: where it is now (its checksum is checked)",
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Let the checkpoint's config name code to run (model.name python:..., a Hub model's own code); "
        "off: a received checkpoint is data",
    ),
) -> None:
    """Merge a sharded checkpoint into one state dict with exactly model.state_dict()'s keys.

    A checkpoint of a run started from model.path reads its frozen weights from that folder."""
    from zoff.checkpoint.convert import convert as run

    files = run(checkpoint, out, fmt, dtype, max_shard_size, merge, base, trust_remote_code)
    print(f"zoff: wrote {len(files)} file(s) to {out}")


@app.command(epilog=_examples("zoff doctor"))
def doctor() -> None:
    """Report this machine as zoff sees it: torch against the checked range, devices, cores, which CPU Adam
    path is active and why, and each dtype's CPU matmul path with its measured time against fp32's."""
    import json

    from zoff.launch.doctor import machine_report

    print(json.dumps(machine_report(), indent=2, default=str))


@app.command("ls", epilog=_examples("zoff ls"))
def ls() -> None:
    """List the shipped configs and recipes with their one-line descriptions."""
    from zoff.config.catalog import listing

    print(listing())


@app.command("cp", epilog=_examples("zoff cp quickstart my.yaml", "zoff cp zero3-offload my-recipe.yaml"))
def cp(
    name: str = typer.Argument(
        ..., help="A config or recipe name from `zoff ls` (recipes/NAME if ambiguous)"
    ),
    dest: Path = typer.Argument(..., help="File to create, or an existing folder to copy into"),
) -> None:
    """Copy a shipped config or recipe out for editing (never overwrites)."""
    from zoff.config.catalog import copy, usage

    target = copy(name, dest)
    print(f"zoff: wrote {target}\n  use it: {usage(name, target)}")


@app.command(
    epilog=_examples("zoff plot runs/qs --out curves.png", "zoff plot runs/a runs/b --out compare.png")
)
def plot(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories (each holds a metrics.jsonl)"),
    out: Path = typer.Option(
        None, "--out", help="PNG to write (default: RUN_DIR/plot.png for one run, zoff-plot.png for several)"
    ),
) -> None:
    """Plot loss, val loss and tokens/s against step, comparing runs, into one PNG."""
    from zoff.trainer.plot import plot_runs

    if out is None:
        out = run_dirs[0] / "plot.png" if len(run_dirs) == 1 else Path("zoff-plot.png")
    plot_runs(run_dirs, out)
    print(f"zoff: wrote {out}")


@app.command(
    "bench-io", epilog=_examples("zoff bench-io /mnt/nvme/zoff", "zoff bench-io /var/tmp --size 4GiB")
)
def bench_io(
    path: Path = typer.Argument(..., help="A folder on the disk the disk tier would use (nvme_path)"),
    size: str = typer.Option("1GiB", "--size", help="Bytes per measurement (e.g. 1GiB, 4GiB)"),
) -> None:
    """Measure a path's O_DIRECT bandwidth and the disk tier's swap throughput; suggest its io: setting."""
    from zoff.planning.bench_io import run
    from zoff.units import parse_size

    for line in run(path, parse_size(size, "--size")):
        print(line, flush=True)


def _make_run_dir(run_dir: Path) -> Path:
    out = Path(run_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".zoff-write-probe-{os.getpid()}"  # per process: agents may share a run dir
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--run-dir: cannot write to {out}: {e.strerror}") from None
    return out


def main() -> None:
    # typer may vendor its own click: take the usage-error base class from typer's exceptions, not click's.
    usage_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    try:
        code = app(standalone_mode=False)  # without standalone mode, typer returns Exit codes instead
        sys.exit(code if isinstance(code, int) else 0)
    except usage_error as e:  # bad flags: one line like every other input error, not click's usage block
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `zoff`: the help, as no_args_is_help promises
            print(e.ctx.get_help() if e.ctx else "", flush=True)
            sys.exit(0)
        print(f"zoff: error: {e.format_message()}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("zoff: interrupted", file=sys.stderr)
        sys.exit(130)
    except UserError as e:
        print(f"zoff: error: {e}", file=sys.stderr)
        sys.exit(2)
