"""Sharded checkpoints that never lose a run.

Layout of <dir>/step_00000100/: one `shard_00000.safetensors` per partition (fp32 master, exp_avg,
exp_avg_sq of that partition's slice of every unit), `rng_00000.safetensors` per rank, `extra.safetensors`
(frozen parameters and buffers, whole), `config.yaml`, and `manifest.json`, written last, which lists every
parameter's pieces and every file's size and checksum. A save goes into a temporary folder that is renamed
into place only after every rank has written and fsynced its files; `latest` is then replaced atomically.
A crash at any moment leaves the previous checkpoint complete. Loading re-partitions: any world size and
any stage read exactly the byte ranges they need.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from zoff.checkpoint.safetensors_io import SafetensorsReader
from zoff.config import CheckpointConfig
from zoff.engine import ZeroEngine
from zoff.engine.partition import PartitionPlan
from zoff.errors import UserError

# 2: per-parameter skipped_steps (its Adam step count) and stage 3's frozen parameters in the shard files;
# version 1 checkpoints load as they are.
FORMAT_VERSION = 2
KINDS = ("master", "exp_avg", "exp_avg_sq")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ------------------------------------------------------------------------------------------------ save


def save_checkpoint(
    engine: ZeroEngine, ckpt_dir: Path, step: int, trainer_state: dict, config_yaml: str
) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    rank, world = engine.comm.rank, engine.comm.world
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f".tmp-{step_dir_name(step)}"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
        tmp.mkdir()
    _barrier(engine)
    files: dict[str, dict] = {}
    state = engine.state_dict()
    if engine.rank == rank:  # this rank owns a partition (stage 0: only rank 0 writes the single partition)
        tensors = {}
        for u in range(len(engine.plan.units)):
            tensors[f"u{u}.master"] = state["masters"][u].detach().float().cpu().contiguous()
            tensors[f"u{u}.exp_avg"] = state["optimizer"]["exp_avg"][u].cpu().contiguous()
            tensors[f"u{u}.exp_avg_sq"] = state["optimizer"]["exp_avg_sq"][u].cpu().contiguous()
        for u in range(len(engine.plan.units), len(engine.plan.all_units)):  # stage 3's frozen shards
            tensors[f"u{u}.master"] = engine.shard_params[u].detach().float().cpu().contiguous()
        files.update(_write(tmp / f"shard_{engine.rank:05d}.safetensors", tensors))
    files.update(_write(tmp / f"rng_{rank:05d}.safetensors", rng_states(engine.device)))
    if rank == 0:
        files.update(_write(tmp / "extra.safetensors", _extra_tensors(engine)))
        (tmp / "config.yaml").write_text(config_yaml)
    _pause_for_tests()
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, files)
    else:
        gathered = [files]
    if rank == 0:
        all_files = {k: v for part in gathered for k, v in part.items()}
        manifest = _manifest(engine, step, trainer_state, all_files)
        _write_json(tmp / "manifest.json", manifest)
        _fsync_dir(tmp)
        if (
            final.exists()
        ):  # a checkpoint of the same step (a rerun): replace it only now that the new one is whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
        _write_text_atomic(ckpt_dir / "latest", final.name + "\n")
    _barrier(engine)
    return final


def prune(ckpt_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (rank 0, after a save completed)."""
    done = complete_checkpoints(ckpt_dir)
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    save_file(tensors, str(path))
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
    return {path.name: {"bytes": path.stat().st_size, "sha256": digest}}


def _extra_tensors(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    trainable = {n for s in engine.plan.all_slots for n in s.names}  # in the shard files
    out = {
        k: v.detach().cpu().contiguous().clone()
        for k, v in engine.model.state_dict().items()
        if k not in trainable
    }
    return out or {"__empty__": torch.zeros(0)}


def _manifest(engine: ZeroEngine, step: int, trainer_state: dict, files: dict) -> dict:
    plan = engine.plan
    params = []
    for i, s in enumerate(plan.all_slots):
        pieces = [
            {
                "file": f"shard_{r:05d}.safetensors",
                "unit": s.unit,
                "start": s.offset + p_start - r * plan.all_units[s.unit].shard,
                "length": length,
                "param_start": p_start,
            }
            for r, p_start, length in plan.pieces(i)
        ]
        entry = {"names": list(s.names), "shape": list(s.shape), "dtype": "float32", "pieces": pieces}
        if i >= len(plan.slots):  # a frozen parameter partitioned at stage 3: values only, no optimizer state
            entry["frozen"] = True
        elif engine.skipped_steps[i]:  # steps without a gradient anywhere: its Adam step count lags this far
            entry["skipped_steps"] = engine.skipped_steps[i]
        params.append(entry)
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": engine.comm.world,
        "partitions": plan.world_size,
        "zero_stage": engine.stage,
        "precision": str(engine.dtype).replace("torch.", ""),
        "optimizer_step": engine.optimizer.step_count,
        "scaler": engine.scaler.state_dict(),
        "trainer": trainer_state,
        "params": params,
        "state_dict_keys": list(engine.model.state_dict().keys()),
        "files": files,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


# ------------------------------------------------------------------------------------------------ find


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints (a manifest is present), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("step_*") if (p / "manifest.json").is_file())


def find_checkpoint(resume: str, ckpt_dir: Path, label: str = "--resume") -> Path | None:
    """`auto`: the latest complete checkpoint in ckpt_dir or None; else the given folder (or a checkpoint dir).

    `label` names the argument in errors (--resume, or convert's CHECKPOINT).
    """
    if resume == "auto":
        pointer = ckpt_dir / "latest"
        if pointer.is_file():
            cand = ckpt_dir / pointer.read_text().strip()
            if (cand / "manifest.json").is_file():
                return cand
        done = complete_checkpoints(ckpt_dir)
        return done[-1] if done else None
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
    keys = m.get("state_dict_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return "'state_dict_keys' must be a list of names"
    return None


def verify_file(path: Path, meta: dict) -> None:
    if not path.is_file():
        raise UserError(f"{path}: missing checkpoint file")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise UserError(f"{path}: truncated or resized ({size} bytes, manifest says {meta['bytes']})")
    with open(path, "rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != meta["sha256"]:
            raise UserError(f"{path}: checksum mismatch (corrupted file)")


# ------------------------------------------------------------------------------------------------ load


def load_checkpoint(engine: ZeroEngine, path: Path, verify: bool = True) -> dict:
    """Load into `engine` whatever its world size and stage; returns the trainer state. Every rank calls it."""
    manifest = read_manifest(path, verify=False)
    by_name = {n: p for p in manifest["params"] for n in p["names"]}
    plan = engine.plan
    for s in plan.slots:
        saved = by_name.get(s.names[0])
        if saved is None:
            raise UserError(f"{path}: checkpoint of a different model (no parameter '{s.names[0]}')")
        if tuple(saved["shape"]) != s.shape:
            raise UserError(
                f"{path}: checkpoint of a different model ('{s.names[0]}' has shape {saved['shape']}, model {list(s.shape)})"
            )
    # Every trainable parameter must be there; frozen ones may sit in the shard files (partitioned at stage
    # 3) or in extra.safetensors (whole), whichever way either run kept them.
    known = {n for s in plan.all_slots for n in s.names} | set(plan.frozen)
    if {n for n, p in by_name.items() if not p.get("frozen")} - known or set(by_name) - known:
        raise UserError(f"{path}: checkpoint of a different model (parameter sets differ)")
    # Each rank checks the size and checksum of exactly the files it opens, once: N ranks do not hash the
    # whole checkpoint N times over (the launcher already checked everything once before starting them).
    with _Readers(path, manifest["files"] if verify else None) as readers:
        state = {
            "masters": [],
            "optimizer": {"step": manifest["optimizer_step"], "exp_avg": [], "exp_avg_sq": []},
        }
        for u in range(len(plan.units)):
            for kind in KINDS:
                shard = _assemble_shard(plan, engine.rank, u, kind, by_name, readers)
                (state["masters"] if kind == "master" else state["optimizer"][kind]).append(shard)
        state["scaler"] = manifest["scaler"]
        state["skipped_steps"] = {
            n: int(p.get("skipped_steps", 0)) for p in manifest["params"] for n in p["names"]
        }
        engine.load_state_dict(state)
        extra = readers.get("extra.safetensors")
        partitioned = {n for s in plan.frozen_slots for n in s.names}
        model_state = {k: extra.read(k) for k in extra.keys() if k != "__empty__" and k not in partitioned}
        # frozen parameters kept whole here but partitioned in the checkpoint
        model_state.update({n: _read_whole(by_name[n], readers) for n in plan.frozen if n in by_name})
        if model_state:
            engine.model.load_state_dict(model_state, strict=False)
        frozen = range(len(plan.units), len(plan.all_units))
        engine.load_frozen_shards(
            [_assemble_shard(plan, engine.rank, u, "master", by_name, readers) for u in frozen]
        )
        rng_file = path / f"rng_{engine.comm.rank:05d}.safetensors"
        if manifest["world_size"] == engine.comm.world and rng_file.is_file():
            rng = readers.get(rng_file.name)
            set_rng_states({k: rng.read(k) for k in rng.keys()}, engine.device)
    return manifest["trainer"]


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


def _assemble_shard(
    plan: PartitionPlan, rank: int, u: int, kind: str, by_name: dict, readers
) -> torch.Tensor:
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


def _read_whole(entry: dict, readers) -> torch.Tensor:
    """A parameter saved in pieces, whole (a frozen parameter loaded where it is not partitioned)."""
    out = torch.zeros(math.prod(entry["shape"]), dtype=torch.float32)
    for piece in entry["pieces"]:
        data = readers.get(piece["file"]).read(f"u{piece['unit']}.master", piece["start"], piece["length"])
        out[piece["param_start"] : piece["param_start"] + piece["length"]] = data
    return out.view(entry["shape"])


class _Readers:
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


# ----------------------------------------------------------------------------------------------- utils


def _barrier(engine: ZeroEngine) -> None:
    if engine.comm.world > 1:
        dist.barrier()


def _pause_for_tests() -> None:
    # Lets the crash-consistency test kill a rank while a save is half written.
    pause = float(os.environ.get("ZOFF_TEST_PAUSE_IN_SAVE", "0") or 0)
    if pause:
        flag = os.environ.get("ZOFF_TEST_PAUSE_FLAG")
        if flag:
            Path(flag).write_text("paused")
        time.sleep(pause)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """The trainer's view of checkpoints: when to save, saving with pruning, and resuming."""

    def __init__(
        self, engine: ZeroEngine, cfg: CheckpointConfig, run_dir: Path, config_yaml: str, max_steps: int
    ):
        self.engine, self.cfg, self.max_steps, self.config_yaml = engine, cfg, max_steps, config_yaml
        self.dir = Path(cfg.dir) if cfg.dir else run_dir / "checkpoints"

    def due(self, step: int) -> bool:
        return step == self.max_steps or bool(self.cfg.every_steps and step % self.cfg.every_steps == 0)

    def save(self, step: int, trainer_state: dict) -> Path:
        path = save_checkpoint(self.engine, self.dir, step, trainer_state, self.config_yaml)
        if self.engine.comm.rank == 0:
            prune(self.dir, self.cfg.keep_last)
        return path

    def resume(self, resume: str | None) -> tuple[int, dict | None]:
        """Load the checkpoint `resume` names (auto: the latest, if any); returns (start step, trainer state)."""
        if not resume:
            return 0, None
        path = find_checkpoint(resume, self.dir)
        if path is None:
            return 0, None
        state = load_checkpoint(self.engine, path)
        return int(state["step"]), state
