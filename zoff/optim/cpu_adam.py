"""Build/load of the fused C++ CPU Adam kernel, its functional entry point and the CPUAdam optimizer.

The extension is compiled on first use with torch.utils.cpp_extension into a directory keyed by torch version,
source, CPU flags and compiler settings (zoff.host.cache: $ZOFF_CACHE_DIR/ext or ~/.cache/zoff/ext). Ranks of one node share it: the
first builds while the others wait on an fcntl lock, so a node compiles once (~40 s) rather than once per rank.
If the build fails, the compiler's output is printed once and zoff falls back to the PyTorch path
(adam_reference) with one warning line. Environment:
  ZOFF_CPU_ADAM_BACKEND=torch          force the fallback (read at every call)
  ZOFF_CPU_ADAM_SIMD=avx512|avx2|scalar force a SIMD path; an error if the CPU lacks it (read at every call)
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from zoff.host.cache import cache_dir, private_dir
from zoff.optim.adam_reference import adam_step_reference

__all__ = ["CPUAdam", "backend_info", "cpu_adam_step"]

_NAME = "zoff_cpu_adam"
_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_adam.cpp"
# -ffp-contract=off: the kernel spells out its FMAs to match torch's operation order; any the compiler added
# on its own would change rounding.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, Any] = {"loaded": False, "ext": None, "reason": "", "build_dir": None}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """The per-node cache directory for this torch version, source, CPU and compiler."""
    key = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        _cpu_flags().encode(),
        " ".join(_CFLAGS + _LDFLAGS).encode(),
        os.environ.get("CXX", "").encode(),
        f"{sys.version_info[:2]}-{torch.__version__}-{torch.compiled_with_cxx11_abi()}".encode(),
    ):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "ext" / f"{torch.__version__.replace('+', '_')}-{key.hexdigest()[:16]}"


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verified_library(directory: Path) -> Path:
    """The built library, only if it is the one the build recorded in `ok` (its sha256): the folder's name is
    the hash of the source and build flags (build_dir), its contents are checked here; ImportError otherwise."""
    lib = directory / f"{_NAME}.so"
    recorded = (directory / "ok").read_text().split()
    if not recorded or not lib.is_file() or lib.is_symlink() or _digest(lib) != recorded[0]:
        raise ImportError(f"{lib} is not the library built there (its sha256 differs from the record)")
    return lib


def _import_built(directory: Path) -> Any:
    spec = importlib.util.spec_from_file_location(_NAME, verified_library(directory))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {directory / (_NAME + '.so')}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(directory: Path) -> Any:
    """Compile (or reuse) the extension under an exclusive file lock; raises on failure."""
    from torch.utils import cpp_extension

    problem = private_dir(directory)  # code is loaded from here: only a folder nobody else can write
    if problem is not None:
        raise _UntrustedCache(f"{problem}: compiled code is not loaded from it")
    ok, failed = directory / "ok", directory / "failed.txt"
    if ok.exists():
        try:
            return _import_built(directory)
        except (ImportError, OSError):
            pass  # a damaged or foreign build: rebuild it under the lock
    started = time.time()
    with open(directory / "zoff.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released by the kernel even if this process dies
        try:
            if ok.exists() and ok.stat().st_mtime >= started:
                return _import_built(directory)  # another rank built it while we waited
            ok.unlink(missing_ok=True)
            if failed.exists() and failed.stat().st_mtime >= started:
                # Another rank failed while we waited: same error, don't compile (and print) it again.
                raise _SharedBuildError(failed.read_text())
            # torch's own lock file is only left behind by a killed build; we hold the real lock, so drop it.
            (directory / "lock").unlink(missing_ok=True)
            try:
                module = cpp_extension.load(
                    name=_NAME,
                    sources=[str(_SOURCE)],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS,
                    build_directory=str(directory),
                    verbose=False,
                )
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
            failed.unlink(missing_ok=True)
            ok.write_text(
                f"{_digest(directory / f'{_NAME}.so')} built {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            )
            return module
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


class _UntrustedCache(RuntimeError):
    """The cache folder could be written by someone else: nothing is built or loaded there."""


class _SharedBuildError(RuntimeError):
    """The build failed in another process of this node; its output was printed there."""


def _summary(text: str) -> str:
    """The compiler's first error line of a build log (not ninja's or torch's framing), for the warning."""
    noise = (
        "[",
        "FAILED",
        "ninja:",
        "Error building extension",
        "In file included",
        "compilation terminated",
    )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(noise) and " -MMD " not in ln and " -shared " not in ln]
    for ln in lines:
        if "error" in ln.lower() or "not found" in ln or "No such file" in ln:
            return ln[:200]
    return (lines[0] if lines else text.strip().splitlines()[0] if text.strip() else "unknown error")[:200]


def _extension() -> Any | None:
    """The loaded extension, or None when the fallback is in use (forced or after a failed build)."""
    if os.environ.get("ZOFF_CPU_ADAM_BACKEND", "").lower() == "torch":
        return None
    if _state["loaded"]:
        return _state["ext"]
    with _lock:
        if _state["loaded"]:
            return _state["ext"]
        directory = build_dir()
        _state["build_dir"] = str(directory)
        try:
            _state["ext"] = _build(directory)
            _state["reason"] = "fused C++ kernel loaded"
        except Exception as exc:  # noqa: BLE001 - any failure means: show it, then fall back
            text = str(exc)
            if not isinstance(exc, (_SharedBuildError, _UntrustedCache)):
                print(f"zoff: building the fused CPU Adam extension failed:\n{text}", file=sys.stderr)
            _state["reason"] = text if isinstance(exc, _UntrustedCache) else f"build failed: {_summary(text)}"
            print(
                f"zoff: warning: fused CPU Adam unavailable ({_state['reason']}); using the PyTorch fallback",
                file=sys.stderr,
                flush=True,
            )
        _state["loaded"] = True
        return _state["ext"]


def backend_info() -> dict[str, Any]:
    """Which CPU Adam path is active and why (loads/builds the extension if needed)."""
    ext = _extension()
    forced = os.environ.get("ZOFF_CPU_ADAM_BACKEND", "").lower() == "torch"
    info: dict[str, Any] = {
        "backend": "cpp" if ext is not None else "torch",
        "simd": None,
        "simd_available": [],
        "reason": "forced by ZOFF_CPU_ADAM_BACKEND=torch" if forced else _state["reason"],
        "build_dir": _state["build_dir"],
        "threads": torch.get_num_threads(),
    }
    if ext is not None:
        info["simd_available"] = list(ext.simd_levels())
        want = os.environ.get("ZOFF_CPU_ADAM_SIMD", "auto")
        info["simd"] = info["simd_available"][0] if want in ("", "auto") else want
    return info


def extension() -> Any | None:
    """The raw extension module (adam_step, simd_levels, stream_probe, stream_triad) or None."""
    return _extension()


def cpu_adam_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
    lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
    adamw_mode: bool = True, bias_correction: bool = True, out16: torch.Tensor | None = None,
    threads: int | None = None, simd: str | None = None, grad_scale: float = 1.0,
) -> None:  # fmt: skip
    """One in-place Adam(W) step on flat contiguous CPU tensors, in one pass over memory.

    param/exp_avg/exp_avg_sq are float32; grad is float32, bfloat16 or float16; ``step`` is the step count
    after this update (1 on the first call). ``out16`` (bfloat16/float16, same numel) receives the new
    param rounded to nearest even. ``threads`` defaults to torch.get_num_threads(); ``simd`` (avx512, avx2,
    scalar, auto) overrides $ZOFF_CPU_ADAM_SIMD. The GIL is released while the kernel runs.
    ``grad_scale``: the step reads ``grad.float() * grad_scale`` (unscaling and clipping), bit for bit as
    ``grad.float().mul_(grad_scale)`` would give, without that fp32 copy (for a 16-bit gradient a second and
    third pass over memory, 4 B/param allocated and page-faulted per call); ``grad`` is not written.
    """
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this update), got {step}")
    consts = (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw_mode))
    if not _kernel(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        out16,
        None,
        int(step),
        consts,
        bias_correction,
        threads,
        simd,
        float(grad_scale),
    ):
        if (
            grad_scale != 1.0
        ):  # the fallback's own pass (out of place: grad is the caller's), the kernel's saving
            grad = grad.float().mul(float(grad_scale))
        adam_step_reference(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction, out16=out16,
        )  # fmt: skip


def _kernel(p, g, m, v, out16, step_t, step, consts, bias_correction, threads, simd, scale=1.0) -> bool:
    """Run the C++ kernel; False if it is unavailable or declines these tensors (odd dtypes, layouts, sizes).

    Kept to one call with no torch ops around it: see adam_step in csrc/cpu_adam.cpp for what they cost.
    """
    # Once loaded, the module is used as is: the kernel itself reads ZOFF_CPU_ADAM_BACKEND/_SIMD (and declines
    # when the torch path is forced), without os.environ's ~50 us per read when cold.
    ext = _state["ext"] if _state["loaded"] else _extension()
    if ext is None:
        return False
    return bool(
        ext.adam_step(
            p, g, m, v, out16, step_t, step, *consts, bias_correction, threads or 0, simd or "", scale
        )
    )


# Private torch names, looked up once and defensively: if one is missing, torch's full step wrapper always runs.
_PROFILING = getattr(torch._C._autograd, "_profiler_enabled", None)
_GLOBAL_HOOKS = [getattr(torch_optimizer, f"_global_optimizer_{k}_hooks", None) for k in ("pre", "post")]


def _step_wrapper_needed(opt: torch.optim.Optimizer) -> bool:
    if _PROFILING is None or None in _GLOBAL_HOOKS:
        return True
    return bool(
        _PROFILING()
        or opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or _GLOBAL_HOOKS[0]
        or _GLOBAL_HOOKS[1]
    )


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for float32 CPU params on the fused kernel; state_dict-compatible with torch.optim.AdamW.

    State per param: ``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq`` — the names and shapes torch
    uses, so state dicts load in either direction. Grads may be float32, bfloat16 or float16.
    ``adamw_mode=False`` is Adam with L2 (torch.optim.Adam(weight_decay=...)).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        threads: int | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"invalid CPUAdam hyper-parameters: lr={lr} betas={betas} eps={eps} wd={weight_decay}"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self.threads = threads

    @staticmethod
    def profile_hook_step(func: Any) -> Any:
        """torch's step wrapper (step hooks and a profiler range), bypassed when it has nothing to do.

        Entering its record_function costs ~150 us right after a large step has pushed the interpreter out of
        the caches (~1% of a 16M-param step). With no hook registered and no profiler running, the wrapper
        would only do that and `_optimizer_step_code`, which still runs.
        """
        full = torch.optim.Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def step(self: CPUAdam, *args: Any, **kwargs: Any) -> Any:
            if _step_wrapper_needed(self):
                return full(self, *args, **kwargs)
            out = func(self, *args, **kwargs)
            self._optimizer_step_code()
            return out

        return step

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # A torch Adam/AdamW state dict names the mode decoupled_weight_decay and has no bias_correction.
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", True))
            group.setdefault("bias_correction", True)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["decoupled_weight_decay"] = group["adamw_mode"]  # read by torch Adam/AdamW on load
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if "decoupled_weight_decay" in group:
                group["adamw_mode"] = bool(group["decoupled_weight_decay"])

    def step(self, closure: Any = None) -> Any:
        """One optimizer step over every param with a grad."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The same call as _kernel, inlined: every Python frame costs a few us when cold.
        ext = _state["ext"] if _state["loaded"] else _extension()
        threads = self.threads or 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            bc = group["bias_correction"]
            consts = (
                float(group["lr"]),
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                group["adamw_mode"],
            )
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # The kernel takes the Parameter itself (not p.data) and counts the step: no torch op here.
                m, v, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                if ext is not None and ext.adam_step(
                    p, grad, m, v, None, step_t, 0, *consts, bc, threads, ""
                ):
                    continue
                if grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                with torch.no_grad():  # only here: the kernel needs no grad mode (~65 us cold to set it)
                    step_t += 1
                    adam_step_reference(
                        p.data, grad, m, v, step=int(step_t.item()), lr=consts[0], beta1=beta1, beta2=beta2,
                        eps=group["eps"], weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                        bias_correction=group["bias_correction"],
                    )  # fmt: skip
        return loss
