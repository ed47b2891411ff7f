"""Reading single tensors out of a Hugging Face model folder's safetensors files, by positioned reads.

A folder holds either one `model.safetensors` or numbered shards (`model-00001-of-00003.safetensors`) with a
`model.safetensors.index.json` whose `weight_map` names each tensor's file. `WeightFiles` resolves a tensor
name to its file and reads its bytes with `os.preadv` straight into the caller's tensor (the engine's flat
buffer, a rank's shard), converting dtype in bounded chunks when the file's dtype differs.

Why not `safetensors.safe_open`: it memory-maps whole files, and every page a read touches stays resident
and counted in the process's RSS until the file is closed, so loading a rank's shard would still grow RSS
towards the whole model. pread copies only what is asked for (the page cache holds the rest, reclaimably).
Headers are parsed by zoff.files.tensorfile, which checkpoints read their shard files with too.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch

from zoff.errors import UserError
from zoff.files.tensorfile import ST_DTYPES, SafetensorsReader

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Conversion of dtype goes through a temporary of at most this many bytes (of the file's dtype), so loading a
# bf16 file into fp32 buffers never holds a second copy of a large tensor.
CHUNK_BYTES = 64 * 2**20


def has_safetensors(folder: str | Path) -> bool:
    """Whether `folder` holds safetensors weights that WeightFiles can read (one file, or shards + index)."""
    folder = Path(folder).expanduser()
    return (folder / SINGLE).is_file() or (folder / INDEX).is_file()


class WeightFiles:
    """The safetensors weights of one model folder: which file holds each tensor, and reads into tensors.

    Files are opened lazily, each once; only headers are parsed up front (the index names the files, each
    file's header its tensors' dtype, shape and byte range)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()
        self.readers: dict[str, SafetensorsReader] = {}
        if (self.folder / INDEX).is_file():
            self.weight_map = self._index(self.folder / INDEX)
        elif (self.folder / SINGLE).is_file():
            self.weight_map = {k: SINGLE for k in self._reader(SINGLE).keys()}
        else:
            raise UserError(f"model.path: {self.folder} holds no {SINGLE} or {INDEX}")

    def _index(self, path: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{path}: 'weight_map' must map tensor names to file names")
        for name in set(
            weight_map.values()
        ):  # a shard named in the index but absent: say so now, not mid-run
            if "/" in name or not (self.folder / name).is_file():
                raise UserError(f"{path}: names shard '{name}', which is not in {self.folder}")
        return weight_map

    def _reader(self, name: str) -> SafetensorsReader:
        if name not in self.readers:
            self.readers[name] = SafetensorsReader(self.folder / name)
        return self.readers[name]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, key: str) -> Path:
        return self.folder / self.weight_map[key]

    def shape(self, key: str) -> list[int]:
        return self._reader(self.weight_map[key]).shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._reader(self.weight_map[key]).dtype(key)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Copy tensor `key` into `out` (same number of elements; any shape, dtype and device)."""
        if key not in self.weight_map:
            raise UserError(f"{self.folder}: no tensor '{key}' in its safetensors files")
        reader = self._reader(self.weight_map[key])
        if key not in reader.meta:  # the index promised it to this file
            raise UserError(f"{reader.path}: has no tensor '{key}' (its index says it does)")
        meta = reader.meta[key]
        src = ST_DTYPES[meta["dtype"]]
        lo, hi = meta["data_offsets"]
        item = src.itemsize
        numel = (hi - lo) // item
        if numel != out.numel():
            raise UserError(
                f"{reader.path}: tensor '{key}' has shape {meta['shape']}, the model wants {list(out.shape)}"
            )
        if not numel:
            return
        flat = out.view(-1) if out.is_contiguous() else None
        if flat is not None and out.dtype == src and out.device.type == "cpu":
            # The common case: the file's bytes land in `out` itself, no temporary at all.
            _pread_exact(reader, key, _bytes_of(flat), reader.base + lo)
            return
        if flat is None:  # a strided destination: through one whole temporary (rare: the engine's are views)
            tmp = torch.empty(numel, dtype=src)
            _pread_exact(reader, key, _bytes_of(tmp), reader.base + lo)
            out.copy_(tmp.view(out.shape))
            return
        step = max(1, CHUNK_BYTES // item)
        buf = torch.empty(min(step, numel), dtype=src)
        for start in range(0, numel, step):
            n = min(step, numel - start)
            part = buf[:n]
            _pread_exact(reader, key, _bytes_of(part), reader.base + lo + start * item)
            flat[start : start + n].copy_(part)  # dtype (and device) conversion on the way in

    def read(self, key: str) -> torch.Tensor:
        """Tensor `key` whole, in the file's dtype (small tensors: buffers)."""
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        self.read_into(key, out)
        return out

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous host tensor's bytes. Not .numpy(): exporting a tensor to numpy marks
    its storage non-resizable, and the engine frees a unit's full buffer by resizing its storage to 0."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _pread_exact(reader: SafetensorsReader, key: str, dst: memoryview, offset: int) -> None:
    """Fill the writable buffer `dst` from the file at `offset`; preadv may return short, so loop."""
    view = dst
    done = 0
    while done < len(view):
        got = os.preadv(reader.fd, [view[done:]], offset + done)
        if got <= 0:
            raise UserError(f"{reader.path}: truncated while reading '{key}'")
        done += got
