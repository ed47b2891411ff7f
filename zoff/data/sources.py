"""Where a corpus's documents come from: the files a data config names (the standard library's sources, text,
JSON lines, Parquet, a `datasets` spec on local files), their documents in order, capped, and split into
train and validation (every k-th document). The token stream built from them is zoff.data's."""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from zoff.config import DataConfig
from zoff.data.jsonl import Bad
from zoff.errors import UserError


def source_files(cfg: DataConfig) -> tuple[list[Path], str]:
    if cfg.name == "stdlib-source":
        return _stdlib_files(), "the Python standard library's .py sources"
    if cfg.name == "hf":
        spec = cfg.hf_dataset
        if not spec.get("path"):
            raise UserError(
                "data.hf_dataset.path: needed for data.name hf (json, parquet, text, csv or a local dataset folder)"
            )
        files = expand_paths(cfg.paths, "data.paths") if cfg.paths else []
        files += expand_paths(_strings(spec.get("data_files")), "data.hf_dataset.data_files")
        if Path(str(spec["path"])).exists():
            root = Path(str(spec["path"]))
            files += sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
        return files, f"datasets.load_dataset({spec.get('path')!r})"
    if not cfg.paths:
        raise UserError(f"data.paths: data.name '{cfg.name}' needs at least one file or glob")
    files = expand_paths(cfg.paths)
    if not files:
        raise UserError(f"data.paths: {cfg.paths} match no file")
    return files, f"{len(files)} {cfg.name} file(s)"


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "idlelib", "dist-packages"}
    files = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # pruned, not filtered: site-packages can be huge
        files.extend(Path(top) / n for n in names if n.endswith(".py"))
    return sorted(files)


def expand_paths(patterns: list[str], key: str = "data.paths") -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(str(Path(pat).expanduser()), recursive=True))
        if not hits:
            raise UserError(f"{key}: '{pat}' matches no file")
        files.extend(Path(h) for h in hits if Path(h).is_file())
    return files


def _strings(value) -> list[str]:
    """The paths in a load_dataset data_files value: a string, a list, or a dict of split -> either."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return [str(v) for v in value]


def file_stat(f: Path) -> tuple[str, int, int]:
    st = f.stat()
    return str(f.resolve()), st.st_size, st.st_mtime_ns


def documents(cfg: DataConfig, files: list[Path]) -> Iterator[str | bytes]:
    """The documents, in order; a bad one is an error or, with data.bad_records: skip, a Bad value that the
    tokenization counts and leaves out."""
    if cfg.name in ("stdlib-source", "text"):
        for f in files:  # bytes: the byte tokenizer keeps them exact; a tokenizer of text decodes them
            raw = f.read_bytes()
            if cfg.tokenizer == "bytes":
                yield raw
                continue
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:  # not text with replacement characters trained on
                yield _bad(cfg, f"{f}: invalid UTF-8 at byte {e.start}")
    elif cfg.name == "jsonl":
        for f in files:
            yield from _jsonl(cfg, f)
    elif cfg.name == "parquet":
        for f in files:
            yield from _texts(cfg, str(f), _parquet(f, cfg.text_field))
    else:
        yield from _texts(cfg, f"data.hf_dataset {cfg.hf_dataset.get('path')}", _hf_dataset(cfg))


def _texts(cfg: DataConfig, where: str, values: Iterable[object]) -> Iterator[str]:
    """A column's texts: an empty cell is no document; a value that is not text is a bad record."""
    for row, t in enumerate(values):
        if isinstance(t, str):
            yield t
        elif t is not None:
            yield _bad(
                cfg, f"{where}: row {row}: data.text_field '{cfg.text_field}' holds {type(t).__name__}"
            )


def _jsonl(cfg: DataConfig, path: Path) -> Iterator[str]:
    """Pretraining text from JSON Lines (jsonl.py bounds and checks each line)."""
    from zoff.data.jsonl import jsonl

    for lineno, obj in jsonl(path, cfg.max_line_bytes):
        text = obj.get(cfg.text_field) if isinstance(obj, dict) else None
        if isinstance(obj, Bad):
            yield _bad(cfg, f"{path}:{lineno}: {obj}")
        elif not isinstance(text, str):
            yield _bad(cfg, f"{path}:{lineno}: no text field '{cfg.text_field}' (data.text_field)")
        else:
            yield text


def _bad(cfg: DataConfig, why: str) -> Bad:
    """A bad pretraining document: the error that stops the run (data.bad_records auto or error), or the
    Bad value the tokenization counts and skips."""
    if cfg.bad_records == "skip":
        return Bad(why)
    raise UserError(f"{why} (data.bad_records: skip leaves such records out)")


def _parquet(path: Path, key: str) -> Iterator[object]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("data.name: parquet needs pyarrow: pip install zoff[data]") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid/OSError family for a bad file
        raise UserError(f"{path}: not a Parquet file ({e})") from None
    if key not in pf.schema_arrow.names:
        raise UserError(
            f"{path}: no column '{key}' (data.text_field); columns: {', '.join(pf.schema_arrow.names)}"
        )
    for batch in pf.iter_batches(columns=[key], batch_size=1024):
        yield from batch.column(0).to_pylist()


def _hf_dataset(cfg: DataConfig) -> Iterator[object]:
    try:
        import datasets
    except ImportError:
        raise UserError("data.name: hf needs the datasets package: pip install zoff[data]") from None
    args = dict(cfg.hf_dataset)
    if "data_files" not in args and cfg.paths:
        args["data_files"] = [str(f) for f in expand_paths(cfg.paths)]
    try:
        ds = datasets.load_dataset(**args)
    except Exception as e:  # datasets raises many kinds: FileNotFoundError, ValueError, its own errors
        raise UserError(f"data.hf_dataset: load_dataset failed: {str(e).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if cfg.text_field not in ds.column_names:
        raise UserError(
            f"data.text_field: the dataset has no column '{cfg.text_field}' (columns: {', '.join(ds.column_names)})"
        )
    for batch in ds.select_columns([cfg.text_field]).iter(batch_size=1024):
        yield from batch[cfg.text_field]


def capped(docs: Iterable[str | bytes], max_bytes: int) -> Iterator[str | bytes]:
    """Stop after max_bytes of text (0: no cap); the last document is cut at the cap."""
    size = 0
    for d in docs:
        if isinstance(d, Bad):  # counted by the tokenization, never trained on
            yield d
            continue
        raw = d if isinstance(d, bytes) else d.encode()
        if max_bytes and size + len(raw) > max_bytes:
            raw = raw[: max_bytes - size]
            d = raw if isinstance(d, bytes) else raw.decode(errors="ignore")
        size += len(raw)
        yield d
        if max_bytes and size >= max_bytes:
            return


def split_documents(docs: Iterable[str | bytes], val_fraction: float) -> Iterator[tuple[bool, str | bytes]]:
    """Every k-th document goes to validation, so both splits sample the whole corpus, not its tail."""
    k = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
    i = 0
    for d in docs:
        if isinstance(d, Bad):  # takes no place: the split of the good documents does not move
            yield False, d
            continue
        yield bool(k and i % k == k - 1), d
        i += 1
