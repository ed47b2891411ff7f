"""What the benchmark scripts share: gloo ranks in fresh processes, the benchmark GPT's config and the
PASS/MISS targets table. The scripts import the installed zoff (`pip install -e .` or a wheel), not tests/."""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from zoff.config import Config, config_from_dict


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
