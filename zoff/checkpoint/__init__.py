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

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zoff.checkpoint.base_ref import check_base
from zoff.checkpoint.format import (
    FORMAT_VERSION,
    KINDS,
    WRITE,
    Readers,
    assemble_shard,
    complete_checkpoints,
    file_entry,
    find_checkpoint,
    fsync_dir,
    read_manifest,
    read_whole,
    replace_folder,
    rng_states,
    set_rng_states,
    step_dir_name,
    write_json,
    write_model_files,
    write_tensors,
    write_text_atomic,
)
from zoff.config import CheckpointConfig
from zoff.engine import ZeroEngine
from zoff.engine.disk.placement import partition_entries
from zoff.engine.disk.swapfile import ALIGN
from zoff.engine.partition import PartitionPlan
from zoff.errors import DiskError, UserError, disk_errors
from zoff.files.tensorfile import write_streaming

# ------------------------------------------------------------------------------------------------ save


def save_checkpoint(
    engine: ZeroEngine,
    ckpt_dir: Path,
    step: int,
    trainer_state: dict,
    config_yaml: str,
    base: dict | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final folder. With `base` (base_ref.base_reference: the
    model.path the run started from), frozen parameters are not saved: the folder holds them."""
    engine.stop_speculation()  # a worker between backward and step owns the disk tier's buffers
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
        files.update(_write_partition(tmp / _shard_file(engine.rank), engine, state, frozen=base is None))
    files.update(write_tensors(tmp / f"rng_{rank:05d}.safetensors", rng_states(engine.device)))
    if rank == 0:
        files.update(write_tensors(tmp / "extra.safetensors", _extra_tensors(engine, frozen=base is None)))
        (tmp / "config.yaml").write_text(config_yaml)
        files.update(file_entry(tmp / "config.yaml"))  # covered by the checksums like every other file
        files.update(
            write_model_files(tmp, engine.model)
        )  # an hf: model's config.json: export needs no model.path
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, files)
    else:
        gathered = [files]
    if rank == 0:
        all_files = {k: v for part in gathered for k, v in part.items()}
        manifest = _manifest(engine, step, trainer_state, all_files, base)
        write_json(tmp / "manifest.json", manifest)
        fsync_dir(tmp)
        if (
            final.exists()
        ):  # a checkpoint of the same step (a rerun): replaced only now that the new one is whole
            replace_folder(tmp, final)
        else:
            os.rename(tmp, final)
        fsync_dir(ckpt_dir)
        write_text_atomic(ckpt_dir / "latest", final.name + "\n")
    _barrier(engine)
    return final


def _write_partition(path: Path, engine: ZeroEngine, state: dict, frozen: bool = True) -> dict[str, dict]:
    """This rank's partition: the masters and moments of every unit, laid out as the disk tier's swap file
    (state_swap.partition_layout). The disk tier copies that file (file to file, no unit through RAM); the
    other tiers stream one unit's tensor at a time from the plan's shapes. Stage 3's frozen shards go to
    frozen_<r>.safetensors beside it, so the shard stays byte for byte a swap file."""
    n, units, rank = len(engine.plan.units), engine.plan.all_units, engine.rank
    files = {}
    digest = engine.optimizer.save_file(path)
    if digest is not None:
        files[path.name] = {"bytes": path.stat().st_size, "sha256": digest}
    else:
        layout = partition_entries([units[u].shard for u in range(n)])
        sources = {"master": state["masters"], **state["optimizer"]}
        tensors = ((f"u{u}.{k}", sources[k][u].detach().float().cpu()) for u in range(n) for k in KINDS)
        with disk_errors(path, WRITE):  # (its errors name the file in their message only)
            write_streaming(path, layout, tensors, align=ALIGN)  # in the order of `layout`: the swap file's
        files.update(file_entry(path))
    if len(units) > n and frozen:
        out = path.with_name(_frozen_file(rank))
        layout = [(f"u{u}.master", [units[u].shard], torch.float32) for u in range(n, len(units))]
        shards = ((f"u{u}.master", engine.param_shard(u).float().cpu()) for u in range(n, len(units)))
        with disk_errors(out, WRITE):
            write_streaming(out, layout, shards)
        files.update(file_entry(out))
    return files


def _shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def _frozen_file(rank: int) -> str:
    return f"frozen_{rank:05d}.safetensors"


def prune(ckpt_dir: Path, keep_last: int, saved: Path | None = None) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (rank 0, after a save completed); never
    `saved`, the one just written (and `latest`), even where higher steps lie beside it (a run resumed from
    an earlier checkpoint: at 51a0203 retention kept the higher step numbers and deleted the new save)."""
    done = [c for c in complete_checkpoints(ckpt_dir) if saved is None or c.name != saved.name]
    for old in done[: max(0, len(done) - keep_last + (saved is not None))]:
        shutil.rmtree(old, ignore_errors=True)


def _extra_tensors(engine: ZeroEngine, frozen: bool = True) -> dict[str, torch.Tensor]:
    """Buffers and the frozen parameters kept whole (unless the base folder holds them: `frozen` False)."""
    skip = {n for s in engine.plan.all_slots for n in s.names}  # in the shard files
    if not frozen:
        skip |= set(engine.plan.frozen)
    out = {
        k: v.detach().cpu().contiguous().clone()
        for k, v in engine.model.state_dict().items()
        if k not in skip
    }
    return out or {"__empty__": torch.zeros(0)}


def _manifest(engine: ZeroEngine, step: int, trainer_state: dict, files: dict, base: dict | None) -> dict:
    plan = engine.plan
    params = []
    slots = plan.all_slots if base is None else plan.slots  # frozen ones: in the base folder
    for i, s in enumerate(slots):
        entry = {
            "names": list(s.names),
            "shape": list(s.shape),
            "dtype": "float32",
            "pieces": _pieces(plan, i),
        }
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
        **({"base": base} if base is not None else {}),
        "files": files,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _pieces(plan: PartitionPlan, i: int) -> list[dict]:
    """Where slot i's elements lie in the partition files of `plan` (frozen ones: in the frozen files)."""
    s = plan.all_slots[i]
    return [
        {
            "file": _shard_file(r) if i < len(plan.slots) else _frozen_file(r),
            "unit": s.unit,
            "start": s.offset + p_start - r * plan.all_units[s.unit].shard,
            "length": length,
            "param_start": p_start,
        }
        for r, p_start, length in plan.pieces(i)
    ]


# ------------------------------------------------------------------------------------------------ load


def load_checkpoint(engine: ZeroEngine, path: Path, verify: bool = True, base: dict | None = None) -> dict:
    """Load into `engine` whatever its world size and stage; returns the trainer state. Every rank calls it.
    A checkpoint that names its base (save_checkpoint) leaves the frozen parameters as the engine read them
    from model.path (`base`: that folder's reference, checked against the saved one)."""
    engine.stop_speculation()
    manifest = read_manifest(path, verify=False)
    from_base = "base" in manifest
    if from_base:
        check_base(manifest["base"], base, path)
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
    if set(by_name) - known:
        raise UserError(f"{path}: checkpoint of a different model (parameter sets differ)")
    # Each rank checks the size and checksum of exactly the files it opens, once: N ranks do not hash the
    # whole checkpoint N times over (the launcher already checked everything once before starting them).
    copied = _copy_partition_file(engine, path, manifest, by_name, verify)
    with Readers(path, manifest["files"] if verify else None) as readers:
        state = {"masters": None, "optimizer": {"step": manifest["optimizer_step"]}}
        if not copied:
            state["masters"] = [
                assemble_shard(plan, engine.rank, u, "master", by_name, readers)
                for u in range(len(plan.units))
            ]
            for kind in KINDS[1:]:
                state["optimizer"][kind] = [
                    assemble_shard(plan, engine.rank, u, kind, by_name, readers)
                    for u in range(len(plan.units))
                ]
        state["scaler"] = manifest["scaler"]
        state["skipped_steps"] = {
            n: int(p.get("skipped_steps", 0)) for p in manifest["params"] for n in p["names"]
        }
        engine.load_state_dict(state)
        extra = readers.get("extra.safetensors")
        partitioned = {n for s in plan.frozen_slots for n in s.names}
        model_state = {k: extra.read(k) for k in extra.keys() if k != "__empty__" and k not in partitioned}
        # frozen parameters kept whole here but partitioned in the checkpoint
        model_state.update({n: read_whole(by_name[n], readers) for n in plan.frozen if n in by_name})
        if model_state:
            engine.model.load_state_dict(model_state, strict=False)
        if not from_base:  # (else the engine read them from model.path, the folder the checkpoint names)
            frozen = range(len(plan.units), len(plan.all_units))
            engine.load_frozen_shards(
                [assemble_shard(plan, engine.rank, u, "master", by_name, readers) for u in frozen]
            )
        rng_file = path / f"rng_{engine.comm.rank:05d}.safetensors"
        if manifest["world_size"] == engine.comm.world and rng_file.is_file():
            rng = readers.get(rng_file.name)
            set_rng_states({k: rng.read(k) for k in rng.keys()}, engine.device)
    return manifest["trainer"]


def _copy_partition_file(engine: ZeroEngine, path: Path, manifest: dict, by_name: dict, verify: bool) -> bool:
    """Resuming the disk tier into the partitioning it was saved with: this rank's shard file is copied into
    its swap file as it is (file to file, checked against the manifest's checksum on the way). False, with
    nothing done, for another partitioning, another tier's layout or a checkpoint from before this layout:
    those are re-assembled piece by piece."""
    plan, name = engine.plan, _shard_file(engine.rank)
    if manifest["partitions"] != plan.world_size or name not in manifest["files"]:
        return False
    if any(by_name[s.names[0]]["pieces"] != _pieces(plan, i) for i, s in enumerate(plan.slots)):
        return False
    digest = engine.optimizer.load_file(path / name)
    if digest is None:
        return False
    if verify and digest != manifest["files"][name]["sha256"]:
        raise UserError(f"{path / name}: checksum mismatch (corrupted file)")
    return True


# ----------------------------------------------------------------------------------------------- utils


def _barrier(engine: ZeroEngine) -> None:
    if engine.comm.world > 1:
        dist.barrier()


class Checkpointer:
    """The trainer's view of checkpoints: when to save, saving with pruning, and resuming."""

    def __init__(
        self,
        engine: ZeroEngine,
        cfg: CheckpointConfig,
        run_dir: Path,
        config_yaml: str,
        max_steps: int,
        base: dict | None = None,
    ):
        self.engine, self.cfg, self.max_steps, self.config_yaml = engine, cfg, max_steps, config_yaml
        self.base = base  # base_ref.base_reference(model): frozen parameters stay in that folder
        self.dir = Path(cfg.dir) if cfg.dir else run_dir / "checkpoints"
        self.reached = 0  # the last step the loop asked about (due): done, so a disk error's is the next

    def step_of(self, error: DiskError) -> int:
        """The step a disk error met during the run happened in: a save's own, else the one after the last
        step done (the last one where it came after it, in the engine's close)."""
        saving = getattr(error, "step", None)
        return saving if saving is not None else min(self.reached + 1, self.max_steps)

    def due(self, step: int, stopping: bool = False) -> bool:
        """Whether to save after `step`: every every_steps, at the end, and when stopping (preemption)."""
        self.reached = step
        if not self.cfg.enabled:
            return False
        return (
            stopping
            or step == self.max_steps
            or bool(self.cfg.every_steps and step % self.cfg.every_steps == 0)
        )

    def save(self, step: int, trainer_state: dict) -> Path:
        """Save step `step`, then prune to keep_last. A disk's I/O error (a full disk, a failing one) raises a
        DiskError naming the file, before anything was renamed, pointed to or pruned: the checkpoints saved
        before stay whole, `latest` on the last of them (save_checkpoint)."""
        try:
            with disk_errors(self.dir, WRITE):
                path = save_checkpoint(
                    self.engine, self.dir, step, trainer_state, self.config_yaml, self.base
                )
        except DiskError as e:
            e.step = step
            raise
        if self.engine.comm.rank == 0:
            prune(self.dir, self.cfg.keep_last, path)
        return path

    def resume(self, resume: str | None) -> tuple[int, dict | None]:
        """Load the checkpoint `resume` names (auto: the latest, if any); returns (start step, trainer state)."""
        if not resume:
            return 0, None
        path = find_checkpoint(resume, self.dir)
        if path is None:
            return 0, None
        state = load_checkpoint(self.engine, path, base=self.base)
        self.reached = int(state["step"])
        return self.reached, state
