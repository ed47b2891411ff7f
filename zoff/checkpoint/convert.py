"""`zoff convert`: merge a sharded checkpoint into one state dict, streaming tensor by tensor.

`--format hf` writes a Hugging Face model folder instead (config.json, safetensors shards, tokenizer files).

Peak memory is about the largest tensor (plus one output shard for the `pt` format): each parameter is
assembled from the byte ranges of the shard files that hold it and written out before the next is read.
Safetensors output is written by hand (8-byte header length, JSON header, raw data) so that the header can
be laid out from the manifest's shapes before any tensor is loaded.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from zoff.checkpoint.format import Readers, find_checkpoint, read_manifest, read_model_files, read_whole
from zoff.engine.precision import DTYPES
from zoff.errors import UserError
from zoff.tensorfile import write_streaming
from zoff.units import parse_size


class _Source:
    """Where each output tensor comes from: its shape and dtype up front, its data on demand (read through the
    checkpoint format's readers: the manifest was verified once, when read)."""

    def __init__(self, ckpt: Path, manifest: dict):
        self.params = {n: p for p in manifest["params"] for n in p["names"]}
        self.readers = Readers(ckpt)
        extra = self.readers.get("extra.safetensors")
        self.extra = {k: (extra.shape(k), extra.dtype(k)) for k in extra.keys() if k != "__empty__"}
        keys = manifest.get("state_dict_keys") or list(self.params) + list(self.extra)
        self.keys = [k for k in keys if k in self.params or k in self.extra]

    def meta(self, key: str) -> tuple[list[int], torch.dtype]:
        if key in self.params:
            return self.params[key]["shape"], torch.float32
        return self.extra[key]

    def tensor(self, key: str) -> torch.Tensor:
        if key in self.extra:
            return self.readers.get("extra.safetensors").read(key)
        return read_whole(self.params[key], self.readers)


def convert(
    checkpoint: Path,
    out: Path,
    fmt: str = "safetensors",
    dtype: str = "fp32",
    max_shard_size: str | None = None,
) -> list[Path]:
    """Write the consolidated state dict (keys exactly model.state_dict()'s) to `out`; returns files written."""
    if fmt not in ("safetensors", "pt", "hf"):
        raise UserError(f"--format: expected safetensors, pt or hf, got '{fmt}'")
    if dtype not in DTYPES:
        raise UserError(f"--dtype: expected one of fp32, bf16, fp16, got '{dtype}'")
    limit = parse_size(max_shard_size, "--max-shard-size") if max_shard_size else None
    if out.exists():
        raise UserError(f"{out}: already exists (zoff convert never overwrites; choose another OUT)")
    if not out.parent.is_dir():
        raise UserError(f"{out}: its folder {out.parent} does not exist")
    ckpt = find_checkpoint(str(checkpoint), Path("."), label="CHECKPOINT")
    src = _Source(ckpt, read_manifest(ckpt, verify=True))
    target = DTYPES[dtype]
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if fmt == "hf":
        tmp.mkdir(parents=True)
        written = _hf_files(ckpt, tmp, out, target)
        # Tied weights are stored once, under the first name, as save_pretrained does; loading re-ties them.
        keys = [k for k in src.keys if k not in src.params or src.params[k]["names"][0] == k]
        written += _write_weights(
            src, keys, tmp, out, "safetensors", target, limit, stem="model", numbered=False
        )
    elif limit is None:  # one file: OUT itself
        written = _write_weights(src, src.keys, tmp, out, fmt, target, None, stem="", numbered=False)
    else:
        tmp.mkdir(parents=True)
        stem = "model" if fmt == "safetensors" else "pytorch_model"
        written = _write_weights(src, src.keys, tmp, out, fmt, target, limit, stem=stem, numbered=True)
    os.replace(tmp, out)
    return written


def _write_weights(
    src: _Source,
    keys: list[str],
    tmp: Path,
    out: Path,
    fmt: str,
    target: torch.dtype,
    limit: int | None,
    *,
    stem: str,
    numbered: bool,
) -> list[Path]:
    """Write `keys` into `tmp` in groups of at most `limit` bytes (limit None: `tmp` is the one file). Shards
    are numbered, with an index.json mapping each key to its file, when `numbered` or when there are several;
    a single group is `stem`.EXT otherwise (a Hugging Face folder's model.safetensors)."""
    out_dtype = lambda dt: target if dt.is_floating_point else dt  # noqa: E731
    sizes = {k: math.prod(src.meta(k)[0]) * out_dtype(src.meta(k)[1]).itemsize for k in keys}
    groups = _group(keys, sizes, limit)
    numbered = numbered or len(groups) > 1
    ext = "safetensors" if fmt == "safetensors" else "bin"
    written, weight_map = [], {}
    with _progress(sum(sizes.values())) as advance:
        if limit is None and not numbered and not stem:
            _write_one(tmp, fmt, src, keys, out_dtype, advance)
            return [out]
        for i, group in enumerate(groups, start=1):
            name = f"{stem}-{i:05d}-of-{len(groups):05d}.{ext}" if numbered else f"{stem}.{ext}"
            _write_one(tmp / name, fmt, src, group, out_dtype, advance)
            weight_map.update({k: name for k in group})
            written.append(out / name)
    if numbered:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / f"{stem}.{ext}.index.json")
    return written


def _hf_files(ckpt: Path, tmp: Path, out: Path, target: torch.dtype) -> list[Path]:
    """A Hugging Face model folder's other files: config.json (and generation_config.json) from what the
    checkpoint carries, or for an older checkpoint rebuilt from the run's config; the tokenizer's files."""
    import yaml

    from zoff.config import config_from_dict
    from zoff.data.tokenize import load_tokenizer
    from zoff.models.hf import save_hf_config

    cfg = config_from_dict(
        yaml.safe_load((ckpt / "config.yaml").read_text()), source=str(ckpt / "config.yaml")
    )
    if not cfg.model.name.startswith("hf:"):
        raise UserError(f"--format hf: the checkpoint's model is '{cfg.model.name}', not an hf: model")
    stored = read_model_files(ckpt)
    path = cfg.model.path
    if (
        "config.json" not in stored
        and path is not None
        and not (Path(path).expanduser() / "config.json").is_file()
    ):
        raise UserError(
            f"--format hf: {ckpt} carries no model config (saved by an older zoff) and model.path {path} "
            "has no config.json any more: restore that folder to export"
        )
    tok = cfg.data.tokenizer  # its files travel with the model; a folder gone since training is skipped
    known = cfg.data.name != "synthetic" and (tok == "bytes" or Path(tok).expanduser().is_dir())
    tokenizer = load_tokenizer(tok) if known else None
    save_hf_config(cfg.model, tmp, target, tokenizer.eos_id if tokenizer else None, stored.get("config.json"))
    written = [out / "config.json"]
    if "generation_config.json" in stored:
        (tmp / "generation_config.json").write_text(
            json.dumps(stored["generation_config.json"], indent=2) + "\n"
        )
        written.append(out / "generation_config.json")
    for f in tokenizer.files() if tokenizer else []:
        shutil.copy2(f, tmp / f.name)
        written.append(out / f.name)
    return written


def _write_one(path: Path, fmt: str, src: _Source, keys: list[str], out_dtype, advance) -> None:
    tensors = ((k, src.tensor(k).to(out_dtype(src.meta(k)[1]))) for k in keys)
    if fmt == "pt":
        torch.save(dict(_counted(tensors, advance)), path)  # a pt file is one pickle: one shard in memory
    else:
        write_streaming(
            path, [(k, src.meta(k)[0], out_dtype(src.meta(k)[1])) for k in keys], _counted(tensors, advance)
        )


def _counted(tensors: Iterator, advance) -> Iterator:
    for k, t in tensors:
        yield k, t
        advance(t.numel() * t.element_size())


def _group(keys: list[str], sizes: dict[str, int], limit: int | None) -> list[list[str]]:
    if limit is None:
        return [keys]
    groups, cur, size = [], [], 0
    for k in keys:
        if cur and size + sizes[k] > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += sizes[k]
    return groups + ([cur] if cur else [])


class _progress:
    def __init__(self, total: int):
        self.bar = Progress(
            TextColumn("convert"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True
        )
        self.task = self.bar.add_task("convert", total=total)

    def __enter__(self):
        self.bar.start()
        return lambda n: self.bar.advance(self.task, n)

    def __exit__(self, *exc) -> None:
        self.bar.stop()
