"""`zoff convert`: merge a sharded checkpoint into one state dict, streaming tensor by tensor.

`--format hf` writes a Hugging Face model folder instead (config.json, safetensors shards, tokenizer files).
A LoRA run's checkpoint exports its adapters as peft's adapter folder (`--format peft`) or merged into the base
(`--merge`): peft_export.py. A checkpoint of a run started from a model.path folder holds no frozen weights
(base_ref.py): they are read from that folder again, after checking it holds the weights the run started from.

Peak memory is about the largest tensor (plus one output shard for the `pt` format): each parameter is
assembled from the byte ranges of the shard files that hold it and written out before the next is read.
Safetensors output is written by hand (8-byte header length, JSON header, raw data) so that the header can
be laid out from the manifest's shapes before any tensor is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from torch import nn

from zoff.checkpoint.base_ref import base_reference, check_base
from zoff.checkpoint.format import Readers, find_checkpoint, read_manifest, read_model_files, read_whole
from zoff.config import Config, ModelConfig
from zoff.engine.precision import DTYPES
from zoff.errors import UserError
from zoff.files.hub import is_hub_id
from zoff.files.tensorfile import write_streaming
from zoff.units import parse_size

if TYPE_CHECKING:
    from zoff.checkpoint.peft_export import TensorSource

FORMATS = ("safetensors", "pt", "hf", "peft")


class _Source:
    """Where each output tensor comes from: its shape and dtype up front, its data on demand (read through the
    checkpoint format's readers: the manifest was verified once, when read). Every key of the model's
    state_dict: those the checkpoint does not hold (the frozen weights of a run started from a model.path)
    come from that base folder, read parameter by parameter through the model's init_parameter."""

    def __init__(self, ckpt: Path, manifest: dict, base: Path | None = None, trust_code: bool = False):
        self.ckpt, self.manifest, self.base = ckpt, manifest, base  # base: where the base folder is now
        self.trust_code = trust_code  # --trust-remote-code: the checkpoint's config may name code to run
        self.params = {n: p for p in manifest["params"] for n in p["names"]}
        self.readers = Readers(ckpt)
        extra = self.readers.get("extra.safetensors")
        self.extra = {k: (extra.shape(k), extra.dtype(k)) for k in extra.keys() if k != "__empty__"}
        self.keys = manifest.get("state_dict_keys") or list(self.params) + list(self.extra)
        self.from_base = [k for k in self.keys if k not in self.params and k not in self.extra]
        self._cfg: Config | None = None
        self._model: nn.Module | None = None
        self._base: dict[str, torch.Tensor] = {}  # frozen name -> the model's parameter (meta, or real)
        self._aliases: dict[str, list[str]] = {}  # frozen name -> every name of its (tied) parameter

    @property
    def cfg(self) -> Config:
        """The run's config (config.yaml in the checkpoint folder)."""
        if self._cfg is None:
            self._cfg = _run_config(self.ckpt, self.trust_code)
            if self.base is not None:  # --base: the folder moved; its checksum is still checked
                model = dataclasses.replace(self._cfg.model, path=str(self.base))
                self._cfg = dataclasses.replace(self._cfg, model=model)
        return self._cfg

    @property
    def adapters(self) -> list[str]:
        from zoff.models.lora import is_adapter

        return [k for k in self.params if is_adapter(k)]

    def meta(self, key: str) -> tuple[list[int], torch.dtype]:
        if key in self.params:
            return self.params[key]["shape"], torch.float32
        if key in self.extra:
            return self.extra[key]
        return list(self._base_param(key).shape), torch.float32  # as the checkpoint keeps parameters

    def tensor(self, key: str) -> torch.Tensor:
        """`key`'s value, always a fresh tensor (the merge adds to it in place)."""
        if key in self.extra:
            return self.readers.get("extra.safetensors").read(key)
        if key in self.params:
            return read_whole(self.params[key], self.readers)
        p = self._base_param(key)
        if not p.is_meta:  # a model built whole (no safetensors in model.path)
            return p.detach().to(torch.float32, copy=True)
        out = torch.empty(p.shape, dtype=torch.float32)
        self._model.init_parameter(key, out)  # reads this tensor alone from the base folder's files
        return out

    def names(self, key: str) -> list[str]:
        """Every name of `key`'s tensor (tied parameters: one tensor, several names), the first one first."""
        if key in self.params:
            return self.params[key]["names"]
        if key in self.extra:
            return [key]
        self._base_param(key)
        return self._aliases[key]

    def model(self) -> nn.Module:
        """The run's model (adapted, with model.lora): built on its base folder when the checkpoint left frozen
        weights there (checking the folder first), else its structure alone, on the meta device."""
        if self._model is None:
            if self.from_base:
                self._model = self._on_base()
            else:
                from zoff.models import meta_model

                with self.structure_config() as model_cfg:
                    self._model = meta_model(model_cfg)
        return self._model

    def _base_param(self, key: str) -> torch.Tensor:
        self.model()
        return self._base[key]

    def _on_base(self) -> nn.Module:
        from zoff.models import build_for_engine

        saved, path = self.manifest.get("base"), self.cfg.model.path
        if saved is None:
            raise UserError(
                f"{self.ckpt}: corrupted checkpoint: it holds no tensor '{self.from_base[0]}' and names no "
                "base folder to read it from"
            )
        folder = Path(path).expanduser() if path else None
        if folder is None or not folder.is_dir():
            raise UserError(
                f"{self.ckpt}: its frozen weights are in the base folder {path or saved['path']}, which does "
                "not exist: restore it, or pass --base PATH to where it is now"
            )
        check_base(saved, base_reference(self.cfg.model), self.ckpt, "--base" if self.base else "model.path")
        # As the trainer builds it: for safetensors folders, parameters on meta and read one by one on demand
        model = build_for_engine(self.cfg.model)
        state, aliases = model.state_dict(keep_vars=True), tied_names(model)
        for key in self.from_base:
            if key not in state:
                raise UserError(f"{self.ckpt}: the model built from its config has no tensor '{key}'")
            self._base[key] = state[key]
            self._aliases[key] = aliases.get(key, [key])
        return model

    @contextmanager
    def structure_config(self) -> Iterator[ModelConfig]:
        """The run's model section, for building its structure on the meta device (nothing is read but
        config.json): where model.path has no config.json any more (the base moved), the config.json this
        checkpoint carries stands in for it, from a temporary folder."""
        model_cfg, stored = self.cfg.model, read_model_files(self.ckpt).get("config.json")
        path = model_cfg.path
        if path is None or (Path(path).expanduser() / "config.json").is_file() or stored is None:
            yield model_cfg
            return
        with tempfile.TemporaryDirectory(prefix="zoff-convert-") as folder:
            (Path(folder) / "config.json").write_text(json.dumps(stored))
            yield dataclasses.replace(model_cfg, path=folder)


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter name -> every name of that parameter (tied weights: one tensor, several names)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _run_config(ckpt: Path, trust_code: bool = False) -> Config:
    """The run's config.yaml (its checksum verified with the manifest): data, never a choice of code. A
    model.name python:... (a module to import) or model.config.trust_remote_code (a Hub model's own code) is
    refused unless the user passes --trust-remote-code, the explicit yes zoff train needs too."""
    from zoff.config import config_from_dict, read_yaml_text

    source = ckpt / "config.yaml"
    raw = read_yaml_text(source, lambda: _utf8(source))
    model = raw.get("model") if isinstance(raw, dict) else None
    if not trust_code and isinstance(model, dict):
        name, extra = model.get("name"), model.get("config")
        if isinstance(name, str) and name.startswith("python:"):
            raise UserError(
                f"{source}: model.name {name[:80]!r} names Python code to import; zoff convert runs code a "
                "checkpoint names only with --trust-remote-code"
            )
        if isinstance(extra, dict) and extra.get("trust_remote_code"):
            raise UserError(
                f"{source}: model.config.trust_remote_code asks to run the model repository's own code; zoff "
                "convert runs code a checkpoint names only with --trust-remote-code"
            )
    return config_from_dict(raw, source=str(source))


def _utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def convert(
    checkpoint: Path,
    out: Path,
    fmt: str = "safetensors",
    dtype: str = "fp32",
    max_shard_size: str | None = None,
    merge: bool = False,
    base: Path | None = None,
    trust_code: bool = False,
) -> list[Path]:
    """Write the consolidated state dict (keys exactly model.state_dict()'s) to `out`; returns files written.

    `merge`: a LoRA checkpoint's adapters merged into their base weights (the unadapted model's keys);
    `fmt` peft: the adapters alone, as peft's adapter folder. `base`: the base folder of a run started from
    model.path, where it is now (default: where the run read it)."""
    if fmt not in FORMATS:
        raise UserError(f"--format: expected safetensors, pt, hf or peft, got '{fmt}'")
    if dtype not in DTYPES:
        raise UserError(f"--dtype: expected one of fp32, bf16, fp16, got '{dtype}'")
    if fmt == "peft" and merge:
        raise UserError("--merge: --format peft writes the adapters alone; merged, use --format hf --merge")
    if fmt == "peft" and max_shard_size:
        raise UserError("--max-shard-size: --format peft writes one adapter file, as peft does")
    limit = parse_size(max_shard_size, "--max-shard-size") if max_shard_size else None
    if out.exists():
        raise UserError(f"{out}: already exists (zoff convert never overwrites; choose another OUT)")
    if not out.parent.is_dir():
        raise UserError(f"{out}: its folder {out.parent} does not exist")
    if base is not None and not (base.expanduser() / "config.json").is_file():
        raise UserError(f"--base: {base} is not a Hugging Face model folder (no config.json)")
    ckpt = find_checkpoint(str(checkpoint), Path("."), label="CHECKPOINT")
    source = _Source(ckpt, read_manifest(ckpt, verify=True), base, trust_code)
    if base is not None and source.manifest.get("base") is None:
        raise UserError(f"--base: {ckpt} was not trained from a model.path folder; it holds every weight")
    _check_lora_request(source, fmt, merge)
    target = DTYPES[dtype]
    src = source
    if merge:
        from zoff.checkpoint.peft_export import MergedSource

        model = source.model()
        src = MergedSource(source, model, tied_names(model))
    elif fmt != "peft" and source.from_base:
        source.model()  # a missing or changed base folder is reported before anything is written
    # A private folder of its own (mkdtemp: a new name, 0700) beside OUT: a leftover or planted `.OUT.tmp`
    # is neither deleted nor followed, and OUT appears whole or not at all.
    try:
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        try:
            tmp = work / out.name
            written = _write(src, source, tmp, out, fmt, target, limit)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except OSError as e:  # a full or read-only disk: one line, and nothing of OUT left behind
        why = e.strerror or str(e).removeprefix("zoff: ")
        raise UserError(f"{out}: cannot write it ({why})") from None
    return written


def _check_lora_request(src: _Source, fmt: str, merge: bool) -> None:
    """The exports a LoRA checkpoint allows, and those that need one."""
    if fmt == "peft" and not src.adapters:
        raise UserError(
            f"--format peft needs a checkpoint trained with model.lora ({src.ckpt} has no adapters)"
        )
    if merge and not src.adapters:
        raise UserError(f"--merge needs a checkpoint trained with model.lora ({src.ckpt} has no adapters)")
    if fmt == "hf" and src.adapters and not merge:
        raise UserError(
            f"--format hf: {src.ckpt} holds LoRA adapters, which a Hugging Face model folder has no place for: "
            "export them with --format peft, or merged into the base with --format hf --merge"
        )


def _write(
    src: TensorSource, source: _Source, tmp: Path, out: Path, fmt: str, target: torch.dtype, limit: int | None
) -> list[Path]:
    """Write `src` (the checkpoint `source`, or its merged view) into `tmp` in format `fmt`."""
    if fmt == "peft":
        from zoff.checkpoint.peft_export import write_peft_folder

        tmp.mkdir(parents=True)
        base = source.manifest.get("base")
        # peft's base_model_name_or_path: where the base is now (--base), else where the run read it
        where = str(source.base.expanduser().resolve()) if source.base else base["path"] if base else None
        with source.structure_config() as model_cfg:
            return write_peft_folder(src, model_cfg, tmp, out, target, where)
    if fmt == "hf":
        tmp.mkdir(parents=True)
        written = _hf_files(source.ckpt, source.cfg, tmp, out, target)
        # Tied weights are stored once, under the first name, as save_pretrained does; loading re-ties them.
        keys = [k for k in src.keys if src.names(k)[0] == k]
        return written + _write_weights(
            src, keys, tmp, out, "safetensors", target, limit, stem="model", numbered=False
        )
    if limit is None:  # one file: OUT itself
        return _write_weights(src, src.keys, tmp, out, fmt, target, None, stem="", numbered=False)
    tmp.mkdir(parents=True)
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    return _write_weights(src, src.keys, tmp, out, fmt, target, limit, stem=stem, numbered=True)


def _write_weights(
    src: TensorSource,
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


def _hf_files(ckpt: Path, cfg: Config, tmp: Path, out: Path, target: torch.dtype) -> list[Path]:
    """A Hugging Face model folder's other files: config.json (and generation_config.json) from what the
    checkpoint carries, or for an older checkpoint rebuilt from the run's config; the tokenizer's files."""
    from zoff.data.tokenize import load_tokenizer
    from zoff.models.hf import save_hf_config

    if not cfg.model.name.startswith("hf:"):
        raise UserError(f"--format hf: the checkpoint's model is '{cfg.model.name}', not an hf: model")
    stored = read_model_files(ckpt)
    path = cfg.model.path
    if (
        "config.json" not in stored
        and path is not None
        and not is_hub_id(path)
        and not (Path(path).expanduser() / "config.json").is_file()
    ):
        raise UserError(
            f"--format hf: {ckpt} carries no model config (saved by an older zoff) and model.path {path} "
            "has no config.json any more: restore that folder to export"
        )
    tok = cfg.data.tokenizer  # its files travel with the model; a folder gone since training is skipped
    known = cfg.data.name != "synthetic" and (
        tok == "bytes" or Path(tok).expanduser().is_dir() or is_hub_id(tok)
    )
    try:
        tokenizer = load_tokenizer(tok, cfg.data.tokenizer_revision) if known else None
    except UserError:  # a Hub tokenizer no longer in this machine's cache: exported without it
        tokenizer = None
    save_hf_config(cfg.model, tmp, target, tokenizer.eos_id if tokenizer else None, stored.get("config.json"))
    written = [out / "config.json"]
    if "generation_config.json" in stored:
        (tmp / "generation_config.json").write_text(
            json.dumps(stored["generation_config.json"], indent=2) + "\n"
        )
        written.append(out / "generation_config.json")
    for f in tokenizer.files() if tokenizer else []:
        if (tmp / f.name).exists():  # the export's own config is never replaced by a folder's file
            continue
        shutil.copy2(f, tmp / f.name)
        written.append(out / f.name)
    return written


def _write_one(path: Path, fmt: str, src: TensorSource, keys: list[str], out_dtype, advance) -> None:
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
