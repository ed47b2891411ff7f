"""YAML config -> typed, validated, frozen dataclasses (one section per concern, in sections.py).

Loading, `key.path=value` overrides, recipes and the checks across sections. Validation happens once, here;
every component downstream receives its own section and trusts it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from zoff.config.schema import build, kind, strip_optional, suggest, to_dict  # noqa: F401  (to_dict: re-exported)
from zoff.config.sections import (  # noqa: F401  (re-exported: the sections are zoff.config's API)
    CheckpointConfig,
    Config,
    DataConfig,
    IoConfig,
    LaunchConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimConfig,
    OptimizerIoConfig,
    ScheduleConfig,
    TrainConfig,
    ZeroConfig,
)
from zoff.errors import ConfigError, UserError
from zoff.units import parse_size

# Shipped inside the package (package data), so an installed wheel finds them as a checkout does; the
# checkout's top-level configs/ and recipes/ are links to these.
RECIPES_DIR = Path(str(resources.files("zoff") / "recipes"))
CONFIGS_DIR = Path(str(resources.files("zoff") / "configs"))


# ---------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config, apply `key.path=value` overrides, resolve the zero recipe, validate.

    A path that does not exist but names a shipped config (`quickstart`, `configs/quickstart.yaml`) reads the
    shipped one: the README's commands then work from an installed wheel, outside a checkout."""
    path = shipped_config(Path(path))
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {kind(raw)}")
    return config_from_dict(raw, overrides, source=str(path))


def shipped_config(path: Path) -> Path:
    """`path` itself when it exists, else the shipped config it names (if any)."""
    if path.exists() or path.parent not in (Path("."), Path("configs")) or path.suffix not in ("", ".yaml"):
        return path
    shipped = CONFIGS_DIR / f"{path.stem}.yaml"
    return shipped if shipped.is_file() else path


def config_from_dict(raw: dict, overrides: typing.Sequence[str] = (), source: str = "<dict>") -> Config:
    raw = _deepcopy(raw)
    if isinstance(raw.get("zero"), str):
        raw["zero"] = _zero_from_name(raw["zero"])
    for item in overrides:
        _apply_override(raw, item)
    if isinstance(raw.get("zero"), str):  # `zero=zero3` on the command line swaps the whole policy
        raw["zero"] = _zero_from_name(raw["zero"])
    if "zero" in raw:
        raw["zero"] = resolve_recipe(raw["zero"], "zero")
    cfg = build(Config, raw, "")
    _check_cross_section(cfg)
    return cfg


def _zero_from_name(name: str) -> dict:
    return {"auto": True} if name == "auto" else {"recipe": name}


# A config is a few hundred values; YAML aliases can make a 500-byte file expand to billions (nine nested
# aliases of nine references each), which any walk over it would take hours for.
MAX_YAML_VALUES = 100_000


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise UserError(f"{path}: config file not found")
    return read_yaml_text(path, lambda: path.read_text())


def read_yaml_text(path: Path, text) -> Any:
    """YAML from `text()` (safe loading), bounded: at most MAX_YAML_VALUES values after aliases, 100 deep,
    no cycles; a UserError naming `path` otherwise."""
    try:
        return _acyclic(yaml.safe_load(text()), str(path), 0, [MAX_YAML_VALUES])
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}: YAML syntax error{where}: {problem}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (expected UTF-8 YAML)") from None
    except RecursionError:
        raise UserError(f"{path}: YAML nested too deeply") from None


def _acyclic(obj: Any, where: str, depth: int = 0, budget: list[int] | None = None) -> Any:
    """YAML aliases can make a mapping contain itself, or expand a small file into billions of values; such a
    config (or a 100-deep one) is refused."""
    budget = [MAX_YAML_VALUES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise UserError(f"{where}: YAML expands to more than {MAX_YAML_VALUES:,} values (aliases repeated?)")
    if depth > 100:
        raise UserError(
            f"{where}: YAML nested too deeply or refers to itself (an alias inside its own anchor)"
        )
    if isinstance(obj, dict):
        for v in obj.values():
            _acyclic(v, where, depth + 1, budget)
    elif isinstance(obj, list):
        for v in obj:
            _acyclic(v, where, depth + 1, budget)
    return obj


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(section: Any, key: str, _seen: tuple[str, ...] = ()) -> Any:
    """Expand `recipe: NAME` (recursively) into the preset's keys; explicit keys win over the preset."""
    if not isinstance(section, dict) or section.get("recipe") is None:
        return section
    name = section["recipe"]
    if not isinstance(name, str):
        raise ConfigError(f"{key}.recipe: expected a recipe name (string), got {kind(name)}")
    if name in _seen:
        raise ConfigError(f"{key}.recipe: recipe cycle {' -> '.join(_seen + (name,))}")
    path = _recipe_file(name, key)
    base = _read_yaml(path)
    if isinstance(base, dict) and "zero" in base:
        base = base["zero"]
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'zero' section")
    base = resolve_recipe(base, key, _seen + (name,))
    merged = _merge(base, {k: v for k, v in section.items() if k != "recipe"})
    merged["recipe"] = name
    return merged


def _recipe_file(name: str, key: str) -> Path:
    """A shipped recipe's file, or a recipe file of the user's (a path ending in .yaml, from `zoff cp`: relative
    to the working directory, as the command line's other paths are)."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{key}: recipe file '{name}' not found (a path ending in .yaml, or a recipe name)"
            )
        return path
    if name not in list_recipes():  # also keeps odd names (slashes, 300 characters) away from the filesystem
        hint = suggest(name, list_recipes())
        raise ConfigError(
            f"{key}: unknown recipe '{name}'{hint} (recipes are in {RECIPES_DIR}; a file of your own: a path "
            "ending in .yaml)"
        )
    return RECIPES_DIR / f"{name}.yaml"


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected KEY.PATH=VALUE")
    dotted, _, text = item.partition("=")
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{item}': empty key in '{dotted}'")
    target = _check_path_exists(keys, item)
    if target is str:  # keep text as typed: YAML 1.1 would read launch.nnodes=1:2 as the base-60 number 62
        value = text
    else:
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
    node = raw
    for i, k in enumerate(keys[:-1]):
        child = node.get(k)
        if isinstance(child, str) and i == 0 and k == "zero":
            child = _zero_from_name(child)
        if not isinstance(child, dict):
            child = {}
        node[k] = child
        node = child
    node[keys[-1]] = value


def _check_path_exists(keys: list[str], item: str) -> Any:
    """Raise unless the dotted path names a config key; return the key's type (Optional stripped)."""
    cls: Any = Config
    for i, k in enumerate(keys):
        names = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
        if names is None:
            if cls is dict:  # free-form section (model.args): anything goes below it
                return Any
            raise ConfigError(f"override '{item}': {'.'.join(keys[:i])} is not a section")
        if k not in names:
            path = ".".join(keys[: i + 1])
            raise ConfigError(
                f"override '{item}': unknown key {path}{suggest(k, list(names), '.'.join(keys[:i]))}"
            )
        cls = strip_optional(typing.get_type_hints(cls)[k])
    return cls


# ------------------------------------------------------------------------------------------- validation


def check_grad_device(zero: ZeroConfig) -> None:
    """offload_optimizer.grad_device against the rest of the section (config load and build_engine)."""
    oo = zero.offload_optimizer
    if oo.grad_device == "nvme" and oo.device != "nvme":
        raise ConfigError("zero.offload_optimizer.grad_device: nvme needs zero.offload_optimizer.device nvme")
    if oo.overlap_step and not (zero.stage == 3 and oo.device in ("cpu", "nvme")):
        raise ConfigError(
            "zero.offload_optimizer.overlap_step: needs zero.stage 3 with zero.offload_optimizer.device cpu or "
            "nvme (zero3-offload, zero3-nvme-opt, zero3-nvme: stage 3's gathers wait for each unit's update); "
            "set it false for any other policy"
        )
    if oo.overlap_step and oo.delay_update:
        raise ConfigError("zero.offload_optimizer.overlap_step: not with delay_update (choose one)")
    if oo.speculate is True and (oo.device == "none" or oo.delay_update):
        raise ConfigError(
            "zero.offload_optimizer.speculate: true needs zero.offload_optimizer.device cpu or nvme without "
            "delay_update (DPU's update already runs beside the next step); use auto or false"
        )


def _check_cross_section(cfg: Config) -> None:
    m, d, t = cfg.model, cfg.data, cfg.train
    if m.name == "gpt":
        if m.d_model % m.n_head:
            raise ConfigError(f"model.d_model: {m.d_model} must be divisible by model.n_head ({m.n_head})")
        if d.seq_len > m.seq_len:
            raise ConfigError(
                f"data.seq_len: {d.seq_len} exceeds the model's context model.seq_len ({m.seq_len})"
            )
    if m.name == "gpt" and d.name != "synthetic" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size: {m.vocab_size} is too small for byte-level data (needs >= 256)")
    if d.name == "text" and not d.paths:
        raise ConfigError("data.paths: data.name 'text' needs at least one file or glob")
    if d.format != "text" and d.name not in ("jsonl", "parquet", "hf"):
        raise ConfigError(
            f"data.name: data.format {d.format} reads one record per example from jsonl, parquet or hf, "
            f"not '{d.name}'"
        )
    if d.format != "text" and d.name != "hf" and not d.paths:
        raise ConfigError(f"data.paths: data.format {d.format} needs the {d.name} file(s) of its records")
    if t.global_batch_size is not None and t.global_batch_size % d.batch_size:
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not a multiple of data.batch_size ({d.batch_size})"
        )
    if t.sequence_parallel > 1:
        _check_sequence_parallel(cfg)
    if t.activation_offload and not t.activation_checkpointing:
        raise ConfigError(
            "train.activation_offload: offloads the inputs activation checkpointing keeps; it needs "
            "train.activation_checkpointing: true"
        )
    oo = cfg.zero.offload_optimizer
    if oo.device == "nvme" and not oo.nvme_path:
        raise ConfigError("zero.offload_optimizer.nvme_path: device nvme needs a directory on a local disk")
    check_grad_device(cfg.zero)
    if oo.host_budget.strip().lower() not in ("auto", "min"):
        try:
            parse_size(oo.host_budget, "zero.offload_optimizer.host_budget", lo=0)
        except UserError as e:
            raise ConfigError(f"{e} (or auto, or min)") from None
    op = cfg.zero.offload_param
    if op.device == "nvme" and not (op.nvme_path or oo.nvme_path):
        raise ConfigError("zero.offload_param.nvme_path: device nvme needs a directory on a local disk")
    nn = cfg.launch.nnodes
    parts = nn.split(":")
    if not (1 <= len(parts) <= 2 and all(p.isdigit() and int(p) >= 1 for p in parts)) or (
        len(parts) == 2 and int(parts[0]) > int(parts[1])
    ):
        raise ConfigError(f"launch.nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got {nn!r}")
    iface = cfg.launch.interface
    if iface is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", iface):
        raise ConfigError(f"launch.interface: expected a network interface name such as eth0, got {iface!r}")
    ep = cfg.launch.rdzv_endpoint
    if ep is not None:
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"launch.rdzv_endpoint: expected HOST:PORT with a port from 1 to 65535, got {ep!r}"
            )
    for i, b in enumerate(cfg.optim.betas):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optim.betas[{i}]: must be in [0, 1), got {b}")


def _check_sequence_parallel(cfg: Config) -> None:
    """What the config alone says about train.sequence_parallel: the shards' length, the builtin GPT's heads.
    (The world size and a transformers model's heads are checked where they are known.)"""
    n, seq = cfg.train.sequence_parallel, cfg.data.seq_len
    if seq % n:
        raise ConfigError(
            f"train.sequence_parallel: {n} does not divide data.seq_len {seq} (each rank holds seq_len / N tokens)"
        )
    if cfg.model.name == "gpt" and cfg.model.n_head % n:
        raise ConfigError(
            f"train.sequence_parallel: {n} does not divide model.n_head {cfg.model.n_head} (each rank attends "
            "with n_head / N heads)"
        )


def data_parallel_size(train: TrainConfig, world_size: int) -> int:
    """The ranks that train different sequences: the world over train.sequence_parallel (whose groups of ranks
    share each sequence), or one line naming the key."""
    n = train.sequence_parallel
    if world_size % n:
        raise ConfigError(
            f"train.sequence_parallel: {n} does not divide the world size {world_size} (each group of {n} "
            "ranks trains the same sequences)"
        )
    return world_size // n


def derive_grad_accum(train: TrainConfig, micro_batch: int, world_size: int) -> int:
    """Micro-batches per step on each rank: from global_batch_size when set, else train.grad_accum. The global
    batch counts sequences: a sequence-parallel group of ranks trains one micro-batch of them together."""
    if train.global_batch_size is None:
        return train.grad_accum
    data_ranks = data_parallel_size(train, world_size)
    per_step = micro_batch * data_ranks
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not divisible by "
            f"data.batch_size x data-parallel ranks ({micro_batch} x {data_ranks} = {per_step})"
        )
    return train.global_batch_size // per_step


# ------------------------------------------------------------------------------------------------ utils


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _deepcopy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deepcopy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deepcopy(v) for v in obj]
    return obj
