"""The base a checkpoint was trained from: a model.path folder named by its path and checksum.

A run that starts from a model.path (fine-tuning, LoRA) keeps its frozen parameters equal to the folder's, so
its checkpoints hold the trainable state only and name the folder instead: a LoRA checkpoint of a 70B base is
megabytes, not 140 GB. Resume and convert read the frozen values from the folder again, after checking that
its weights are the ones the run started from (their SHA-256, computed once per file version and cached).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from zoff.config import ModelConfig
from zoff.errors import UserError
from zoff.files.hub import model_folder
from zoff.host.cache import cache_dir as zoff_cache_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_CHUNK = 16 << 20


def base_reference(cfg: ModelConfig) -> dict | None:
    """{"path", "sha256"} of model.path's weight files, or None for a model built from its config."""
    if cfg.path is None:
        return None
    folder = model_folder(cfg).resolve()
    return {"path": str(folder), "sha256": weights_digest(folder)}


def weights_digest(folder: Path) -> str:
    """One SHA-256 over the folder's weight files (names and contents). Hashing a 140 GB base takes minutes,
    so each file's digest is cached under its (path, size, mtime): later runs pay a stat per file."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise UserError(f"model.path: {folder} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    cache_file = zoff_cache_dir() / "weight-digests.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    total = hashlib.sha256()
    changed = False
    for f in files:
        st = f.stat()
        key = f"{f}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            cache[key] = _file_digest(f)
            changed = True
        total.update(f.name.encode() + b"\0" + cache[key].encode() + b"\0")
    if changed:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{id(cache)}")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_file)
        except OSError:  # a read-only cache: the digest is recomputed next time, nothing else is lost
            pass
    return total.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_base(saved: dict, now: dict | None, ckpt: Path, key: str = "model.path") -> None:
    """A checkpoint that names its base resumes only on that base (its frozen weights are not in it)."""
    if now is None:
        raise UserError(
            f"{ckpt}: the checkpoint holds only the trainable state of a run on the base {saved['path']}; "
            "set model.path to that folder to resume it"
        )
    if now["sha256"] != saved["sha256"]:
        raise UserError(
            f"{key}: {now['path']} holds other weights than the base this checkpoint was trained on "
            f"({saved['path']}, sha256 {saved['sha256'][:12]}..., now {now['sha256'][:12]}...)"
        )
