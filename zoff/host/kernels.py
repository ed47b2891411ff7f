"""Whether this host has fast CPU matmul kernels for a 16-bit dtype, and how much slower it is when not.

Without AVX512 (AVX512-BF16/AMX, or AVX512-FP16), torch computes bf16 and fp16 matmuls on the CPU with a
reference kernel: on an AMD EPYC showing only AVX2 (torch 2.13), a 256x3072 by 3072x3072 bf16 matmul took
11.3 s against 0.08 s in fp32, 137x. A bf16 run on such a host is not broken, only that much slower, and
nothing else in the run says why: the start-up plan, `zoff doctor`, `zoff estimate --time` and the benchmarks
all read `matmul_path` to say so, and `train.cpu_precision` (config) chooses what to do about it.

Two signals, both cheap: torch's capability check (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`, and fp16's)
and a probe that times one small matmul in the dtype against fp32 (about 0.2 s on the slow path, ~10 ms on a fast one:
128x512 by 512x512). The factor is the probe's; the capability says whether the oneDNN kernel exists.

`ZOFF_MATMUL_FACTOR` (e.g. `bf16:137,fp16:90`) sets the factor instead of measuring it, and with it the
verdict: tests force a slow host this way on a fast one, and a user can override a probe that misjudges
(a host whose cores are busy with other work).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

SLOW_FACTOR = (
    4.0  # a 16-bit matmul this many times slower than fp32 is "no fast kernel": with one it is ~0.5-2x
)
FACTOR_ENV = "ZOFF_MATMUL_FACTOR"
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class MatmulPath:
    dtype: str  # bf16 | fp16 | fp32
    kernel: bool  # torch's oneDNN kernel for the dtype exists on this CPU (always True for fp32)
    factor: float  # the dtype's matmul time over fp32's, on this host's CPU
    source: str  # "probe" or the environment variable that set the factor

    @property
    def slow(self) -> bool:
        return self.factor >= SLOW_FACTOR

    def describe(self) -> str:
        """One line: the path, its factor against fp32 and where the factor came from."""
        kind = "oneDNN kernel" if self.kernel else "reference kernel (no oneDNN kernel on this CPU)"
        return f"{self.dtype} matmul on the CPU: {kind}, {self.factor:.0f}x fp32's time on one core ({self.source})"


def _capability(dtype: torch.dtype) -> bool:
    checks = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }
    check = getattr(torch.ops.mkldnn, checks.get(dtype, ""), None) if dtype in checks else None
    try:
        return bool(check()) if check is not None else dtype == torch.float32
    except RuntimeError:  # a build without oneDNN: no kernel
        return False


def _forced(name: str) -> float | None:
    """The factor ZOFF_MATMUL_FACTOR gives this dtype, or None (unset, or names other dtypes)."""
    for item in filter(None, os.environ.get(FACTOR_ENV, "").split(",")):
        key, _, value = item.partition(":")
        if key.strip() == name:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{FACTOR_ENV}: {item!r} is not DTYPE:FACTOR (e.g. bf16:137)") from None
    return None


def _time_matmul(dtype: torch.dtype, reps: int, give_up_after: float = float("inf")) -> float:
    """Best of `reps` timings of one 128x512 by 512x512 matmul (67 MFLOP: ~1 ms in fp32 on one core, ~0.16 s
    on a reference 16-bit kernel). The first call is timed too and ends the probe when it takes longer than
    `give_up_after` (a path that slow needs no second look). The size is what makes it robust: a smaller
    matmul's time is noise under load; one thread, since a parallel region waits for its slowest thread."""
    a, b = torch.randn(128, 512).to(dtype), torch.randn(512, 512).to(dtype)
    best = float("inf")
    for i in range(reps + 1):
        t = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - t
        if i == 0 and elapsed > give_up_after:
            return elapsed
        best = min(best, elapsed) if i else best
    return best


@functools.cache
def matmul_path(dtype: torch.dtype) -> MatmulPath:
    """How this host's CPU computes matmuls in `dtype`, measured once per process (~0.2 s where slow)."""
    name = _NAMES.get(dtype, str(dtype))
    forced = _forced(name)
    if forced is not None:
        return MatmulPath(
            name, kernel=_capability(dtype) and forced < SLOW_FACTOR, factor=forced, source=FACTOR_ENV
        )
    if dtype == torch.float32:
        return MatmulPath(name, kernel=True, factor=1.0, source="probe")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a parallel region waits for its slowest thread: on a busy host, a timeslice
    try:
        fp32 = max(_time_matmul(torch.float32, reps=5), 1e-7)
        factor = _time_matmul(dtype, reps=3, give_up_after=20 * fp32) / fp32
    finally:
        torch.set_num_threads(threads)
    return MatmulPath(name, kernel=_capability(dtype), factor=factor, source="probe")


def slow_dtype(precision: str) -> MatmulPath | None:
    """The matmul path of a run's precision ("bf16"/"fp16"/"fp32") when it is slow on this CPU, else None."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return None
    path = matmul_path(dtype)
    return path if path.slow else None


def compute_precision(precision: str, cpu_precision: str, on_cpu: bool) -> tuple[str, str | None]:
    """(the precision a rank's matmuls compute in, the plan's line about it or None), from `train.precision`
    and `train.cpu_precision` (native | fp32 | upcast | auto). A rank on a GPU computes as configured; on the
    CPU, fp32 computes in fp32 (its states too), upcast in fp32 over the configured 16-bit states (`upcasts`),
    auto in fp32 only where the configured 16-bit dtype has no fast kernel (`slow_dtype`), and native as
    configured, with a line saying how much slower it is where it is slow."""
    if not on_cpu or precision == "fp32":
        return precision, None
    fp32_note = (
        f"fp32's numbers, not {precision}'s; 16 B/param of model states either way, the parameters and "
        "gradients in fp32"
    )
    if cpu_precision == "upcast":  # (no probe either)
        return (
            "fp32",
            f"  train.cpu_precision=upcast: computing in fp32 on the CPU over {precision} storage (the "
            f"parameters, gradients and their files stay {precision}, the activations are fp32; numbers: fp32 "
            f"products of {precision} weights, gradients rounded to {precision}: zoff/models/upcast.py)",
        )
    if cpu_precision == "fp32":  # (no probe: the answer does not depend on the host)
        return (
            "fp32",
            f"  train.cpu_precision=fp32: computing in fp32 on the CPU, not {precision} ({fp32_note})",
        )
    slow = slow_dtype(precision)
    if slow is None:
        return precision, None
    if cpu_precision == "auto":
        return "fp32", (
            f"  train.cpu_precision=auto: computing in fp32, not {precision}: {slow.describe()} ({fp32_note})"
        )
    return precision, (
        f"  WARNING: {slow.describe()}: a {precision} step here runs about that much slower than in fp32; "
        f"train.cpu_precision=auto computes in fp32 on such a host ({fp32_note}); train.cpu_precision=upcast "
        f"computes in fp32 over {precision} storage"
    )


def upcasts(precision: str, cpu_precision: str, on_cpu: bool) -> bool:
    """Whether a rank computes a 16-bit model in fp32 over its 16-bit storage (train.cpu_precision=upcast:
    zoff.models.upcast); compute_precision then says "fp32" and the states keep `precision`."""
    return on_cpu and precision != "fp32" and cpu_precision == "upcast"
