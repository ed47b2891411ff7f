"""What the benchmark scripts share: the benchmark GPT's config and the PASS/MISS targets table."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from zoff.config import Config, config_from_dict


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
    """One row per {target, value, limit, result}; PASS green, MISS red."""
    tab = Table(title=title)
    for col in ("target", "value", "limit", "result"):
        tab.add_column(col)
    for row in targets:
        style = {"PASS": "green", "MISS": "red"}.get(row["result"], "dim")
        tab.add_row(
            row["target"],
            f"{row['value']:.{digits}f}",
            f"<= {row['limit']:.{digits}f}",
            f"[{style}]{row['result']}[/]",
        )
    con.print(tab)
