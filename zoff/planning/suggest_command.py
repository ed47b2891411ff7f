"""`zoff estimate --suggest`'s answer as something to run: the `zoff train` line that trains the suggested row,
and the overrides behind it (which `--write FILE` applies to the config and writes out as YAML).

The line keeps the config and the user's own overrides and adds only the keys the row changes: the policy
as zero.stage / zero.offload_*.device (not `zero=NAME`, which would swap the config's whole zero section and
lose its nvme_path or tuning, so the run would differ from the row that was estimated), activation
checkpointing, the row's zero_changes, train.sequence_parallel, and the GPUs per node and nodes."""

from __future__ import annotations

import shlex
from pathlib import Path

from zoff.config import Config
from zoff.planning.fits import PolicyEstimate


def suggested_overrides(cfg: Config, pe: PolicyEstimate, sequence_parallel: int) -> list[str]:
    """The key=value items that turn `cfg` into the suggested row's config (none already as configured)."""
    p = pe.policy
    wanted = {
        "zero.stage": (cfg.zero.stage, p.stage),
        "zero.offload_optimizer.device": (cfg.zero.offload_optimizer.device, p.offload_optimizer),
        "zero.offload_param.device": (cfg.zero.offload_param.device, p.offload_param),
        "train.activation_checkpointing": (cfg.train.activation_checkpointing, p.activation_checkpointing),
        **{f"zero.{k}": (_current(cfg, k), v) for k, v in pe.zero_changes},
        "train.sequence_parallel": (cfg.train.sequence_parallel, sequence_parallel),
    }
    wanted.update(_unsupported(cfg, p))
    return [f"{key}={_text(new)}" for key, (old, new) in wanted.items() if old != new]


def _unsupported(cfg: Config, p) -> dict[str, tuple]:
    """The configured keys the suggested policy cannot take (config load would refuse them: check_grad_device,
    train.activation_offload), set to what the estimate's row assumed: off, or auto."""
    oo, t, offload = cfg.zero.offload_optimizer, cfg.train, p.offload_optimizer != "none"
    out = {}
    if oo.grad_device == "nvme" and p.offload_optimizer != "nvme":
        out["zero.offload_optimizer.grad_device"] = (oo.grad_device, "auto")
    if oo.overlap_step and not (p.stage == 3 and offload):
        out["zero.offload_optimizer.overlap_step"] = (True, False)
    if oo.speculate is True and not offload:
        out["zero.offload_optimizer.speculate"] = (True, "auto")
    if t.activation_offload and not p.activation_checkpointing:
        out["train.activation_offload"] = (True, False)
    return out


def suggested_command(
    config: Path, overrides: list[str], cfg: Config, extra: list[str], gpus_per_node: int, nodes: int
) -> str:
    """`zoff train CONFIG OVERRIDES... EXTRA... [--nproc-per-node G] [--nnodes N]`, quoted for a shell."""
    argv = ["zoff", "train", str(config), *overrides, *extra]
    if gpus_per_node != cfg.launch.nproc_per_node:
        argv += ["--nproc-per-node", str(gpus_per_node)]
    if nodes != cfg.launch.min_nodes:
        argv += ["--nnodes", str(nodes)]
    return shlex.join(argv)


def _current(cfg: Config, key: str):
    value = cfg.zero
    for part in key.split("."):
        value = getattr(value, part)
    return tuple(value) if isinstance(value, list) else value


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)
