"""The safetensors file format, read and written by hand where the library's API costs memory: checkpoints'
shard files (zoff.checkpoint) and Hugging Face model folders' weights (zoff.models.safetensors_reader).

Reading: `SafetensorsReader` parses the header and reads element ranges with pread. The library's safe_open
memory-maps the file, and every page a slice touches stays resident (and counted in RSS) until the file is
closed, so converting a checkpoint would grow to the size of the model. pread keeps only what is asked for.

Writing: `write_streaming` lays the header out from shapes alone and then writes tensors one at a time, so a
consolidated file never has to be in memory whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from zoff.errors import UserError, os_error

ST_NAMES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
ST_DTYPES = {v: k for k, v in ST_NAMES.items()}
MAX_HEADER = 100 * 2**20  # a larger header is a corrupted length field, not a real file


class SafetensorsReader:
    """Header of one safetensors file, and reads of element ranges of its tensors."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = -1  # set first: __del__ runs even when the open below fails
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise UserError(f"{path}: cannot open safetensors file ({e.strerror})") from None
        size = os.fstat(self.fd).st_size
        raw = os.pread(self.fd, 8, 0)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(MAX_HEADER, size - 8):
            self.close()
            raise UserError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
            self.base = 8 + n
            self.meta = {k: v for k, v in header.items() if k != "__metadata__"}
            for k, v in self.meta.items():
                _check_entry(k, v, size - self.base)
        except RecursionError:  # JSON nested past the parser's depth (json recurses once per level)
            self.close()
            raise UserError(f"{path}: corrupted safetensors header (nested too deep)") from None
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            self.close()
            raise UserError(f"{path}: corrupted safetensors header ({str(e)[:200]})") from None

    def keys(self) -> list[str]:
        return list(self.meta)

    def shape(self, key: str) -> list[int]:
        return list(self.meta[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return ST_DTYPES[self.meta[key]["dtype"]]

    def read(self, key: str, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Elements [start, start+length) of the flattened tensor `key` (the whole tensor by default)."""
        if key not in self.meta:
            raise UserError(f"{self.path}: checkpoint file has no tensor '{key}'")
        m = self.meta[key]
        dt = ST_DTYPES[m["dtype"]]
        item = torch.empty(0, dtype=dt).element_size()
        lo, hi = m["data_offsets"]
        numel = (hi - lo) // item
        length = numel - start if length is None else length
        if start < 0 or start + length > numel:
            raise UserError(
                f"{self.path}: tensor '{key}' has {numel} elements, asked for [{start}, {start + length})"
            )
        buf = bytearray(length * item)
        got = os.preadv(self.fd, [buf], self.base + lo + start * item) if length else 0
        if got != len(buf):
            raise UserError(f"{self.path}: truncated while reading '{key}'")
        flat = torch.frombuffer(buf, dtype=dt) if length else torch.empty(0, dtype=dt)
        return flat if length != numel else flat.view(m["shape"])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def _check_entry(key: str, v: object, data_bytes: int) -> None:
    """One header entry is a dtype zoff reads, a shape of non-negative integers and a byte range inside the
    data that holds exactly that shape: every later read and view can then trust it."""
    if not isinstance(v, dict) or not isinstance(v.get("dtype"), str) or v["dtype"] not in ST_DTYPES:
        dtype = v.get("dtype") if isinstance(v, dict) else v
        raise ValueError(f"tensor {key!r} has dtype {str(dtype)[:40]}, which zoff does not read")
    shape, offsets = v.get("shape"), v.get("data_offsets")
    ints = lambda xs, n=None: (  # noqa: E731
        isinstance(xs, list) and (n is None or len(xs) == n)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    )  # fmt: skip
    if not ints(shape) or len(shape) > 64 or any(x >= 1 << 48 for x in shape):
        raise ValueError(f"tensor {key!r} has shape {str(shape)[:80]}, not a list of sizes")
    if not ints(offsets, 2) or not offsets[0] <= offsets[1] <= data_bytes:
        raise ValueError(f"tensor {key!r} lies past the end of the file")
    item = torch.empty(0, dtype=ST_DTYPES[v["dtype"]]).element_size()
    if _numel(shape) * item != offsets[1] - offsets[0]:
        raise ValueError(f"tensor {key!r}: shape {shape} does not fill its {offsets[1] - offsets[0]} bytes")


@dataclass(frozen=True)
class FileLayout:
    """Where every tensor of a safetensors file lies: its header (the length prefix included), each tensor's
    absolute byte offset, and the file's size."""

    header: bytes
    offsets: dict[str, int]
    nbytes: int


def file_layout(layout: list[tuple[str, list[int], torch.dtype]], align: int | None = None) -> FileLayout:
    """The safetensors file of `layout`, tensors in that order. With `align`, the data section and every
    tensor start on an `align`-byte boundary of the file and the file ends on one: the gaps are zero-filled
    `__pad<j>__` uint8 tensors (the format allows no holes between tensors) and the header is padded with
    spaces. Disk-tier swap files use 4096 (O_DIRECT's alignment), so a swap file is a checkpoint shard."""
    header, offsets, pos = {}, {}, 0

    def pad(gap: int) -> None:
        nonlocal pos
        header[f"__pad{len(header) - len(offsets)}__"] = {
            "dtype": "U8",
            "shape": [gap],
            "data_offsets": [pos, pos + gap],
        }
        pos += gap

    for key, shape, dt in layout:
        if align and pos % align:
            pad(align - pos % align)
        n = _numel(shape) * dt.itemsize
        header[key] = {"dtype": ST_NAMES[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets[key], pos = pos, pos + n
    if align and pos % align:
        pad(align - pos % align)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % (align or 8))  # data starts aligned (the format asks for 8 at least)
    base = 8 + len(blob)
    return FileLayout(
        len(blob).to_bytes(8, "little") + blob, {k: base + o for k, o in offsets.items()}, base + pos
    )


def write_streaming(
    path: Path, layout: list[tuple[str, list[int], torch.dtype]], tensors: Iterable, align: int | None = None
) -> None:
    """Write (key, tensor) pairs in `layout` order; the header comes from `layout` before any data is read.
    With `align`, as file_layout lays it out (the padding is left as holes, which read as zeros)."""
    where = file_layout(layout, align)
    try:
        with open(path, "wb") as f:
            f.write(where.header)
            for key, t in tensors:
                f.seek(where.offsets[key])
                if t.numel():
                    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no extra copy
            f.truncate(where.nbytes)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk: say which file (the caller turns it into its one-line error)
        raise os_error(e, f"zoff: cannot write {path}: {e.strerror or e}") from None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
