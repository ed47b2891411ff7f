"""Fine-tuning records, one per example, from jsonl, Parquet or a `datasets` folder: (where, record) pairs, where
names the file and line or row for messages about a bad record."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

from zoff.config import DataConfig
from zoff.data.sources import expand_paths
from zoff.errors import UserError

HF_BATCH = 1024  # rows per read from a datasets.Dataset


class BadRecord(Exception):
    """A record that makes no example: counted, skipped, and the first one named in the warning."""


def record_fields(cfg: DataConfig) -> dict[str, str]:
    """The record fields the format reads -> the config key that names each."""
    if cfg.format == "chat":
        return {cfg.messages_field: "data.messages_field"}
    return {cfg.prompt_field: "data.prompt_field", cfg.response_field: "data.response_field"}


def read_records(cfg: DataConfig, files: list[Path]) -> Iterator[tuple[str, object]]:
    """(where, record) pairs; a record that is not even an object comes as a BadRecord."""
    if cfg.name == "jsonl":
        for f in files:
            yield from _jsonl_records(f, cfg.max_line_bytes)
    elif cfg.name == "parquet":
        for f in files:
            yield from _parquet_records(f, record_fields(cfg))
    else:
        yield from _hf_records(cfg, record_fields(cfg))


def _jsonl_records(path: Path, max_line_bytes: int) -> Iterator[tuple[str, object]]:
    from zoff.data.jsonl import Bad, jsonl

    for lineno, obj in jsonl(path, max_line_bytes):
        yield f"{path}:{lineno}", BadRecord(str(obj)) if isinstance(obj, Bad) else obj


def _missing(have: list[str], fields: dict[str, str], where: object) -> None:
    for name, key in fields.items():
        if name not in have:
            raise UserError(f"{where}: no column '{name}' ({key}); columns: {', '.join(have)}")


def optional_module(module: str, why: str):
    """An optional dependency, or one line saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = "hf" if module == "transformers" else "data"
        raise UserError(f"{why}: pip install zoff[{extra}]") from None


def _parquet_records(path: Path, fields: dict[str, str]) -> Iterator[tuple[str, object]]:
    pq = optional_module("pyarrow.parquet", "data.name: parquet needs pyarrow")
    try:
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow's ArrowInvalid/OSError family
        raise UserError(f"{path}: not a Parquet file ({e})") from None
    _missing(names, fields, path)
    batches = pq.ParquetFile(path).iter_batches(columns=list(fields), batch_size=HF_BATCH)
    for row, rec in enumerate(rec for batch in batches for rec in batch.to_pylist()):
        yield f"{path}:row {row}", rec


def _hf_records(cfg: DataConfig, fields: dict[str, str]) -> Iterator[tuple[str, object]]:
    """A folder written by Dataset(Dict).save_to_disk, or any datasets.load_dataset spec."""
    datasets = optional_module("datasets", "data.name: hf needs the datasets package")
    spec = dict(cfg.hf_dataset)
    folder = Path(str(spec["path"])).expanduser()
    try:
        if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(folder))  # load_dataset refuses save_to_disk folders
        else:
            if "data_files" not in spec and cfg.paths:
                spec["data_files"] = [str(f) for f in expand_paths(cfg.paths)]
            ds = datasets.load_dataset(**spec)
    except Exception as e:  # FileNotFoundError, ValueError, datasets' own errors
        raise UserError(f"data.hf_dataset: cannot load {spec['path']}: {str(e).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        split = spec.get("split") or ("train" if "train" in ds else next(iter(ds)))
        ds = ds[split]
    _missing(ds.column_names, fields, f"data.hf_dataset {spec['path']}")
    row = 0
    for batch in ds.select_columns(list(fields)).iter(batch_size=HF_BATCH):
        for values in zip(*(batch[f] for f in fields)):
            yield f"{spec['path']}[{row}]", dict(zip(fields, values))
            row += 1
