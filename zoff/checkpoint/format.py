"""The checkpoint format: the step folder's name, files written with their checksums, the manifest and its
checks, readers over a checkpoint's safetensors files, and re-partitioning a unit's shard from the pieces the
manifest lists (any world size, any stage). Shared by save/load (this package's __init__) and convert."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from zoff.engine.partition import PartitionPlan
from zoff.engine.step.states import KINDS  # noqa: F401  (re-exported: the states a shard file holds)
from zoff.errors import DiskError, UserError, disk_errors
from zoff.files.tensorfile import SafetensorsReader

# 2: per-parameter skipped_steps (its Adam step count) and stage 3's frozen parameters in the shard files;
# version 1 checkpoints load as they are.
FORMAT_VERSION = 2
WRITE = "checkpoint write"  # what a disk's I/O error during a save says was being done (errors.DiskError)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    try:
        save_file(tensors, str(path))
    except SafetensorError as e:  # (its I/O errors are not OSErrors: the errno is in the message)
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise DiskError(OSError(int(code[1]), os.strerror(int(code[1]))), path, WRITE) from None
    return file_entry(path)


def umask() -> int:
    """This process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_entry(path: Path) -> dict[str, dict]:
    """A written file's manifest entry (size and sha256), fsynced first: what load_checkpoint verifies.

    Every checkpoint file gets the same mode, 0666 less the umask, as any file the user writes (safetensors
    creates its files 0600, the others followed the umask: docs/checkpoints.md)."""
    with disk_errors(path, WRITE):  # (fsync: where a disk's write-back error surfaces)
        os.chmod(path, 0o666 & ~umask())
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        return {path.name: {"bytes": path.stat().st_size, "sha256": digest}}


# What a checkpoint carries beside the tensors to describe the model (a transformers model's config.json and
# generation_config.json), under names that say they are not the checkpoint's own files.
MODEL_FILES = {"config.json": "hf_config.json", "generation_config.json": "hf_generation_config.json"}


def write_model_files(folder: Path, model: torch.nn.Module) -> dict[str, dict]:
    """Write the model's description files into a checkpoint folder (rank 0, beside config.yaml); returns
    their manifest entries. An hf: model's config travels with its checkpoint, so `zoff convert --format hf`
    works after the model folder the run started from is gone. Nothing for models without such files."""
    from zoff.models.hf import exported_files  # transformers itself is only imported by the model's config

    files = {}
    for name, text in exported_files(model).items():
        path = folder / MODEL_FILES[name]
        path.write_text(text)
        files.update(file_entry(path))  # (fsyncs it)
    return files


def read_model_files(ckpt: Path) -> dict[str, dict]:
    """The model description files a checkpoint carries, parsed ({"config.json": {...}, ...}); empty for a
    checkpoint of a model without them, or one saved before zoff stored them."""
    out = {}
    for name, stored in MODEL_FILES.items():
        path = ckpt / stored
        if path.is_file():
            try:
                out[name] = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"{path}: corrupted model description ({e})") from None
    return out


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints (a manifest is present), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(
        p for p in ckpt_dir.glob("step_*") if not p.is_symlink() and (p / "manifest.json").is_file()
    )


PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


def plain_name(name: str) -> bool:
    """A file name a checkpoint may use: no folder part, no '..', no hidden or absolute path."""
    return isinstance(name, str) and bool(PLAIN_NAME.fullmatch(name)) and ".." not in name


def _pointed(ckpt_dir: Path) -> Path | None:
    """The folder `latest` names, if it is a plain name of a folder inside ckpt_dir (else None: ignored)."""
    pointer = ckpt_dir / "latest"
    if pointer.is_symlink() or not pointer.is_file() or pointer.stat().st_size > 256:
        return None
    name = pointer.read_text(errors="replace").strip()
    cand = ckpt_dir / name
    return cand if plain_name(name) and cand.is_dir() and not cand.is_symlink() else None


def newest_intact(ckpt_dir: Path, verify: bool) -> tuple[Path | None, list[str]]:
    """The newest checkpoint in ckpt_dir whose manifest reads and whose files check out (every checksum with
    `verify`, else every size), and one line per newer one skipped, naming why."""
    cands = complete_checkpoints(ckpt_dir)
    pointed = _pointed(ckpt_dir)
    if pointed is not None and pointed in cands:  # `latest` first (it may name an older step: a rerun)
        cands = [c for c in cands if c != pointed] + [pointed]
    skipped = []
    for cand in reversed(cands):
        try:
            manifest = read_manifest(cand, verify=verify)
            if not verify:
                for name, meta in manifest["files"].items():
                    check_size(cand / name, meta)
            return cand, skipped
        except UserError as e:
            skipped.append(f"skipped {cand.name}: {e}")
    return None, skipped


def find_checkpoint(resume: str, ckpt_dir: Path, label: str = "--resume") -> Path | None:
    """`auto`: the newest intact checkpoint in ckpt_dir (newest_intact, sizes checked) or None; else the
    given folder (or a checkpoint dir).

    `label` names the argument in errors (--resume, or convert's CHECKPOINT).
    """
    if resume == "auto":
        return newest_intact(ckpt_dir, verify=False)[0]
    path = Path(resume)
    if not path.exists():
        raise UserError(f"{label}: {path} does not exist")
    if (path / "manifest.json").is_file():
        return path
    done = complete_checkpoints(path)
    if done:
        return done[-1]
    raise UserError(f"{label}: {path} holds no complete checkpoint (no manifest.json)")


def read_manifest(path: Path, verify: bool = True) -> dict:
    """Read and check a checkpoint's manifest; with `verify`, check every file's size and checksum."""
    mf = path / "manifest.json"
    if not mf.is_file():
        raise UserError(f"{mf}: missing manifest (incomplete or not a zoff checkpoint)")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{mf}: corrupted manifest ({e})") from None
    if not isinstance(manifest, dict) or "format_version" not in manifest or "files" not in manifest:
        raise UserError(f"{mf}: not a zoff checkpoint manifest")
    problem = _manifest_problem(manifest)
    if problem:
        raise UserError(f"{mf}: corrupted manifest ({problem})")
    if manifest["format_version"] > FORMAT_VERSION:
        raise UserError(
            f"{mf}: format version {manifest['format_version']} is newer than this zoff reads ({FORMAT_VERSION})"
        )
    if verify:
        for name, meta in manifest["files"].items():
            verify_file(path / name, meta)
    return manifest


def _manifest_problem(m: dict) -> str | None:
    """What is structurally wrong with a manifest (None if nothing): checked once, so readers can trust it."""
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not is_int(m.get("format_version")):
        return "format_version is not a whole number"
    for k in ("step", "world_size", "partitions", "optimizer_step"):
        if not is_int(m.get(k)):
            return f"'{k}' is missing or not a whole number"
    files = m.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and is_int(v.get("bytes")) and isinstance(v.get("sha256"), str)
        for v in files.values()
    ):
        return "'files' must map file names to their bytes and sha256"
    outside = next((n for n in files if not plain_name(n)), None)
    if outside is not None:  # ../x, /etc/passwd, sub/dir: a reader must never leave the folder
        return f"file name {outside[:60]!r} is not a plain name inside the checkpoint folder"
    if not isinstance(m.get("scaler"), dict) or not isinstance(m.get("trainer"), dict):
        return "'scaler' or 'trainer' is missing"
    params = m.get("params")
    if not isinstance(params, list):
        return "'params' is missing"
    for p in params:
        ok = (
            isinstance(p, dict)
            and isinstance(p.get("names"), list) and p["names"] and all(isinstance(n, str) for n in p["names"])
            and isinstance(p.get("shape"), list) and all(is_int(d) for d in p["shape"])
            and isinstance(p.get("pieces"), list)
            and all(
                isinstance(q, dict) and q.get("file") in files
                and all(is_int(q.get(k)) for k in ("unit", "start", "length", "param_start"))
                for q in p["pieces"]
            )
        )  # fmt: skip
        if not ok:
            return f"entry {str(p)[:60]!r} of 'params' is malformed"
        gap = _coverage_problem(p)
        if gap:
            return f"parameter {p['names'][0][:80]!r}: {gap}"
    keys = m.get("state_dict_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return "'state_dict_keys' must be a list of names"
    return None


def check_size(path: Path, meta: dict) -> None:
    """The file is a regular file (not a planted link) of the manifest's size."""
    if path.is_symlink() or not path.is_file():
        raise UserError(f"{path}: missing checkpoint file")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise UserError(f"{path}: truncated or resized ({size} bytes, manifest says {meta['bytes']})")


MAX_PARAM_ELEMENTS = 1 << 40  # a parameter of more elements is no model's (4 TiB in fp32)


def _coverage_problem(p: dict) -> str | None:
    """Why a parameter's pieces do not tile it exactly (a gap would convert to zeros, a piece past its end
    would read or write out of bounds), or None."""
    numel = math.prod(p["shape"])
    if numel > MAX_PARAM_ELEMENTS:
        return f"shape {p['shape'][:8]} is larger than any model's parameter"
    pos = 0
    for start, length in sorted((q["param_start"], q["length"]) for q in p["pieces"]):
        if start != pos:
            return f"its pieces {'overlap' if start < pos else 'leave a gap'} at element {pos}"
        pos += length
    if pos != numel:
        return f"its pieces hold {pos} of its {numel} elements"
    return None


def verify_file(path: Path, meta: dict) -> None:
    check_size(path, meta)
    with open(path, "rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != meta["sha256"]:
            raise UserError(f"{path}: checksum mismatch (corrupted file)")


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generators: the host one, and the CUDA one that dropout on a GPU draws from."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore rng_states(); a GPU run resumed on a host-only machine (or the reverse) keeps only the host one."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def assemble_shard(plan: PartitionPlan, rank: int, u: int, kind: str, by_name: dict, readers) -> torch.Tensor:
    """This rank's shard of unit u in the current plan, filled from the saved pieces that overlap it (or, for
    a frozen parameter the checkpoint kept whole, from extra.safetensors)."""
    unit = plan.all_units[u]
    lo, hi = plan.shard_range(u, rank)
    out = torch.zeros(unit.shard, dtype=torch.float32)
    for si in unit.slots:
        s = plan.all_slots[si]
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)  # unit coordinates
        if a >= b:
            continue
        pa, pb = a - s.offset, b - s.offset  # flattened-parameter coordinates
        if s.names[0] not in by_name:
            whole = readers.get("extra.safetensors").read(s.names[0]).reshape(-1)
            out[a - lo : b - lo] = whole[pa:pb]
            continue
        for piece in by_name[s.names[0]]["pieces"]:
            qa, qb = max(pa, piece["param_start"]), min(pb, piece["param_start"] + piece["length"])
            if qa >= qb:
                continue
            src = piece["start"] + (qa - piece["param_start"])
            data = readers.get(piece["file"]).read(f"u{piece['unit']}.{kind}", src, qb - qa)
            dst = s.offset + qa - lo
            out[dst : dst + (qb - qa)] = data
    return out


def read_whole(entry: dict, readers) -> torch.Tensor:
    """A parameter saved in pieces, whole (a frozen parameter loaded where it is not partitioned)."""
    out = torch.zeros(math.prod(entry["shape"]), dtype=torch.float32)
    for piece in entry["pieces"]:
        data = readers.get(piece["file"]).read(f"u{piece['unit']}.master", piece["start"], piece["length"])
        out[piece["param_start"] : piece["param_start"] + piece["length"]] = data
    return out.view(entry["shape"])


class Readers:
    """Opens each checkpoint file once, lazily (verified against `files` first when given)."""

    def __init__(self, root: Path, files: dict | None = None):
        self.root, self.files, self.open = root, files, {}

    def get(self, name: str) -> SafetensorsReader:
        if name not in self.open:
            if self.files is not None:
                if name not in self.files:
                    raise UserError(f"{self.root / name}: not listed in the manifest")
                verify_file(self.root / name, self.files[name])
            self.open[name] = SafetensorsReader(self.root / name)
        return self.open[name]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for r in self.open.values():
            r.close()
        self.open.clear()


def write_json(path: Path, obj: dict) -> None:
    with disk_errors(path, WRITE), open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with disk_errors(tmp, WRITE):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_folder(new: Path, final: Path) -> None:
    """Put folder `new` at `final`, which exists: swapped in one step (renameat2 RENAME_EXCHANGE) where the
    file system can, so no moment leaves `final` missing; else the old one is moved aside first and removed
    only after the new one is in place. Then the old contents are deleted."""
    import ctypes
    import shutil

    aside = final.with_name(f".old-{final.name}")
    libc = ctypes.CDLL(None, use_errno=True)
    swap = getattr(libc, "renameat2", None)
    at_fdcwd, rename_exchange = -100, 2
    if swap is not None and swap(at_fdcwd, bytes(new), at_fdcwd, bytes(final), rename_exchange) == 0:
        shutil.rmtree(new)  # (holds the old checkpoint now)
        return
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(final, aside)
    os.rename(new, final)
    shutil.rmtree(aside)


def fsync_dir(path: Path) -> None:
    with disk_errors(path, WRITE):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
