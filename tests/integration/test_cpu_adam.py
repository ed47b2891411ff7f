"""Numerics, state and build/fallback behaviour of the fused CPU Adam (zoff/csrc/cpu_adam.cpp)."""

from __future__ import annotations

import functools
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from zoff.optim import CPUAdam, backend_info, cpu_adam_step
from zoff.optim.adam_reference import adam_step_reference

SIZES = [1, 7, 15, 16, 17, 1000003]
STEPS = 100
LR = 1e-3
SIMD_LEVELS = ["avx512", "avx2", "scalar"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    info = backend_info()
    if os.environ.get("ZOFF_CPU_ADAM_BACKEND", "") != "torch":
        assert info["backend"] == "cpp", f"fused kernel did not load: {info['reason']}"


def _simd(level: str) -> str:
    if level not in backend_info()["simd_available"]:
        pytest.skip(f"this CPU lacks {level}")
    return level


@functools.lru_cache(maxsize=4)
def _grad_pool(n: int, seed: int) -> torch.Tensor:
    return torch.randn(5, n, generator=torch.Generator().manual_seed(seed))


def _grad(n: int, step: int, seed: int) -> torch.Tensor:
    """Step-dependent gradients from a small cached pool: fresh randn per step would dominate the run time."""
    return _grad_pool(n, seed)[step % 5] * (0.25 + (step % 7) / 4)


def _init(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def assert_adam_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Per element |a - e| <= 1e-6 * max(|e|, rms(e)).

    torch's foreach=False path takes sqrt through a vectorised routine that is one ulp off for ~0.7% of
    elements of large tensors, so nothing correctly rounded matches it bit for bit; an element that decays
    towards 0 keeps the absolute error it had at the tensor's scale, hence the rms floor. Bit-exactness is
    checked against torch's fused kernel (correctly rounded sqrt) in test_bitwise_equal_to_torch_fused.
    """
    scale = expected.double().pow(2).mean().sqrt().clamp_min(1e-30)
    err = (actual.double() - expected.double()).abs()
    bound = 1e-6 * torch.maximum(expected.double().abs(), scale)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max error {worst:.3g}x the 1e-6 bound (max abs err {err.max().item():.3g})"


@functools.lru_cache(maxsize=8)
def _torch_trajectory(n: int, adamw: bool, wd: float, steps: int) -> tuple[torch.Tensor, ...]:
    """p, exp_avg, exp_avg_sq after `steps` of torch Adam(W)(foreach=False) on seeded grads (cached)."""
    p = torch.nn.Parameter(_init(n, 1))
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([p], lr=LR, weight_decay=wd, foreach=False)
    for s in range(1, steps + 1):
        p.grad = _grad(n, s, 2)
        opt.step()
    st = opt.state[p]
    return p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_fp32(n: int, adamw: bool, wd: float, simd: str) -> None:
    simd = _simd(simd)
    p, m, v = _init(n, 1), torch.zeros(n), torch.zeros(n)
    for s in range(1, STEPS + 1):
        cpu_adam_step(p, _grad(n, s, 2), m, v, step=s, lr=LR, weight_decay=wd, adamw_mode=adamw, simd=simd)
    ref_p, ref_m, ref_v = _torch_trajectory(n, adamw, wd, STEPS)
    assert_adam_close(p, ref_p)
    assert_adam_close(m, ref_m)
    assert_adam_close(v, ref_v)


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
def test_bitwise_equal_to_torch_fused(adamw: bool, simd: str) -> None:
    # A multiple of 16 keeps torch's fused kernel on its vector path (its scalar tail rounds the decay
    # factor differently); zoff's kernel gives identical bits on every path, tails included.
    simd, n = _simd(simd), 4096
    ref = torch.nn.Parameter(_init(n, 3))
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], lr=1e-2, weight_decay=0.1, fused=True)
    p, m, v = _init(n, 3), torch.zeros(n), torch.zeros(n)
    for s in range(1, STEPS + 1):
        g = _grad(n, s, 4)
        ref.grad = g.clone()
        opt.step()
        cpu_adam_step(p, g, m, v, step=s, lr=1e-2, weight_decay=0.1, adamw_mode=adamw, simd=simd)
    assert torch.equal(p, ref.detach())
    assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])


@functools.lru_cache(maxsize=4)
def _torch_trajectory_16bit_grads(n: int, gdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.nn.Parameter(_init(n, 5))
    opt = torch.optim.AdamW([ref], lr=LR, weight_decay=0.01, foreach=False)
    for s in range(1, STEPS + 1):
        ref.grad = _grad(n, s, 6).to(gdtype).float()
        opt.step()
    return ref.detach().clone(), opt.state[ref]["exp_avg"].clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaNs in the same places (payloads aside)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_nonfinite_grads_match_torch_fused(simd: str) -> None:
    # g*g overflowing to inf exercises the inf guard of the divider-free division by sqrt(bias_correction2).
    simd, n = _simd(simd), 48
    g = _grad(n, 1, 16)
    g[[3, 20, 33]] = torch.tensor([1e30, float("inf"), float("nan")])
    g[40] = -3e25
    ref = torch.nn.Parameter(_init(n, 17))
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    p, m, v = _init(n, 17), torch.zeros(n), torch.zeros(n)
    for s in range(1, 4):
        ref.grad = g.clone()
        opt.step()
        cpu_adam_step(p, g, m, v, step=s, lr=1e-2, weight_decay=0.1, simd=simd)
    st = opt.state[ref]
    assert _same(p, ref.detach()) and _same(m, st["exp_avg"]) and _same(v, st["exp_avg_sq"])


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [17, 100003])
def test_16bit_grads_match_torch_on_upcast(n: int, gdtype: torch.dtype, simd: str) -> None:
    simd = _simd(simd)
    p, m, v = _init(n, 5), torch.zeros(n), torch.zeros(n)
    for s in range(1, STEPS + 1):
        cpu_adam_step(p, _grad(n, s, 6).to(gdtype), m, v, step=s, lr=LR, weight_decay=0.01, simd=simd)
    ref_p, ref_m = _torch_trajectory_16bit_grads(n, gdtype)
    assert_adam_close(p, ref_p)
    assert_adam_close(m, ref_m)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize(
    "gdtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
def test_grad_scale_is_bitwise_the_scaled_fp32_copy(
    monkeypatch: pytest.MonkeyPatch, adamw: bool, gdtype: torch.dtype, simd: str, backend: str
) -> None:
    # The engine hands a 16-bit gradient and its clipping/unscaling coefficient to the kernel instead of
    # grad.float().mul_(coef): every bit must stay what that copy gave (mul, not mul_: fp32 .float() is g), tails (n = 37) and 1e-30-sized
    # products (denormal after scaling) included, and the gradient itself must stay unwritten.
    simd, n = _simd(simd), 4096 + 37
    if backend == "torch":
        monkeypatch.setenv("ZOFF_CPU_ADAM_BACKEND", "torch")
    g = (_grad(n, 1, 18) * torch.logspace(-36, 2, n)).to(gdtype)
    g[5] = float("inf") if gdtype != torch.float16 else g[5]
    before = g.clone()
    out = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
    states = [(_init(n, 19), _init(n, 20).abs(), _init(n, 21).abs()) for _ in range(2)]
    for s, scale in enumerate((0.37, 1.0 / 3.0, 1.0, 2.0**-16 * 0.813), start=1):
        (p, m, v), (q, mq, vq) = states
        cpu_adam_step(p, g, m, v, step=s, lr=1e-2, weight_decay=0.1, adamw_mode=adamw, simd=simd,
                      grad_scale=scale, out16=out[0])  # fmt: skip
        cpu_adam_step(q, g.float().mul(scale), mq, vq, step=s, lr=1e-2, weight_decay=0.1, adamw_mode=adamw,
                      simd=simd, out16=out[1])  # fmt: skip
        assert _same(p, q) and _same(m, mq) and _same(v, vq) and _same(out[0].float(), out[1].float()), scale
    assert torch.equal(g.isnan(), before.isnan()) and torch.equal(g.nan_to_num(0), before.nan_to_num(0))


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("odtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_out16_is_bit_exact_rounding(odtype: torch.dtype, simd: str) -> None:
    simd, n = _simd(simd), 40009
    p, m, v = _init(n, 7) * 3, torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=odtype)
    for s in range(1, 6):
        g = _grad(n, s, 8).to(torch.bfloat16)
        cpu_adam_step(p, g, m, v, step=s, lr=0.05, out16=out, simd=simd)
        assert torch.equal(out.view(torch.int16), p.to(odtype).view(torch.int16)), f"step {s}"
    # Ties, overflow to inf, 16-bit subnormals, signed zeros, inf: lr=0 leaves p as is, so out16 = p rounded.
    tiny = torch.finfo(torch.float32).tiny
    special = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 65520.0, 70000.0, 3.0e38, 1e-6, 3e-8]
    special += [tiny * 3, 1e-40, 0.0, -0.0, float("inf"), -float("inf"), -(1 + 2**-8), 65504.0]
    sp = torch.tensor(special, dtype=torch.float32)
    out = torch.empty(len(sp), dtype=odtype)
    z = torch.zeros(len(sp))
    cpu_adam_step(sp, z.clone(), z.clone(), z.clone(), step=1, lr=0.0, out16=out, simd=simd)
    assert torch.equal(sp, torch.tensor(special, dtype=torch.float32))
    assert torch.equal(out.view(torch.int16), sp.to(odtype).view(torch.int16))


def test_threads_and_paths_give_identical_bits() -> None:
    n, results = 300007, []
    for simd in backend_info()["simd_available"]:
        for threads in (1, 2):
            p, m, v = _init(n, 9), torch.zeros(n), torch.zeros(n)
            out = torch.empty(n, dtype=torch.bfloat16)
            for s in range(1, 4):
                g = _grad(n, s, 10).half()
                cpu_adam_step(
                    p, g, m, v, step=s, lr=LR, weight_decay=0.1, out16=out, threads=threads, simd=simd
                )
            results.append(torch.cat([p, m, v, out.float()]))
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
def test_no_bias_correction_matches_reference_formula(adamw: bool) -> None:
    n = 1031
    a, b = [_init(n, 11) for _ in range(2)]
    sa, sb = [torch.zeros(n) for _ in range(2)], [torch.zeros(n) for _ in range(2)]
    for s in range(1, STEPS + 1):
        g = _grad(n, s, 12)
        kw = dict(step=s, lr=LR, weight_decay=0.1, adamw_mode=adamw, bias_correction=False)
        cpu_adam_step(a, g, *sa, **kw)
        adam_step_reference(b, g, *sb, **kw)
    assert_adam_close(a, b)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 13, generator=gen)
        (model(x) - x[:, :3].sin()).pow(2).mean().backward()  # a target that keeps the weights O(0.1)
        opt.step()


def _saved(sd: dict) -> dict:
    """A state dict as it comes back from disk (load_state_dict would otherwise alias the source's tensors)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_state_dict_round_trip() -> None:
    m1, m2 = _model(), _model()
    o1 = CPUAdam(m1.parameters(), lr=1e-2, weight_decay=0.1)
    _train(m1, o1, 5, seed=1)
    m2.load_state_dict(m1.state_dict())
    o2 = CPUAdam(m2.parameters(), lr=1e-2, weight_decay=0.1)
    o2.load_state_dict(_saved(o1.state_dict()))
    st = o2.state[next(iter(m2.parameters()))]
    assert st["step"].dtype == torch.float32 and st["step"].item() == 5.0
    _train(m1, o1, 5, seed=2)
    _train(m2, o2, 5, seed=2)
    assert torch.equal(_params(m1), _params(m2))


@pytest.mark.parametrize("direction", ["torch_to_zoff", "zoff_to_torch"])
def test_state_dict_cross_loads_with_torch_adamw(direction: str) -> None:
    def make(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
        if kind == "torch":
            return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        return CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)

    first, second = ("torch", "zoff") if direction == "torch_to_zoff" else ("zoff", "torch")
    src_model, dst_model, ref_model = _model(), _model(), _model()
    src = make(first, src_model)
    _train(src_model, src, 5, seed=1)
    for m in (dst_model, ref_model):
        m.load_state_dict(src_model.state_dict())
    dst, ref = make(second, dst_model), make(first, ref_model)
    dst.load_state_dict(_saved(src.state_dict()))
    ref.load_state_dict(_saved(src.state_dict()))
    assert dst.param_groups[0]["weight_decay"] == 0.1
    if second == "zoff":
        assert dst.param_groups[0]["adamw_mode"] is True
    else:
        assert dst.param_groups[0]["decoupled_weight_decay"] is True
    _train(dst_model, dst, 20, seed=2)
    _train(ref_model, ref, 20, seed=2)
    assert_adam_close(_params(dst_model), _params(ref_model))


def test_cpuadam_matches_torch_with_simd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for level in backend_info()["simd_available"]:
        monkeypatch.setenv("ZOFF_CPU_ADAM_SIMD", level)
        m1, m2 = _model(), _model()
        _train(m1, CPUAdam(m1.parameters(), lr=1e-2, weight_decay=0.1, threads=2), STEPS, seed=3)
        _train(
            m2, torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, foreach=False), STEPS, seed=3
        )
        assert_adam_close(_params(m1), _params(m2))
    monkeypatch.setenv("ZOFF_CPU_ADAM_SIMD", "sse9")
    with pytest.raises(RuntimeError, match="unknown SIMD level"):
        cpu_adam_step(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, lr=LR)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
def test_forced_torch_fallback_matches(monkeypatch: pytest.MonkeyPatch, adamw: bool) -> None:
    monkeypatch.setenv("ZOFF_CPU_ADAM_BACKEND", "torch")
    assert backend_info()["backend"] == "torch"
    m1, m2 = _model(), _model()
    # A bf16 grad goes through the fallback's upcast; the fp32 path through torch's fused kernel.
    _train(m1, CPUAdam(m1.parameters(), lr=1e-2, weight_decay=0.1, adamw_mode=adamw), STEPS, seed=4)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    _train(m2, ref_cls(m2.parameters(), lr=1e-2, weight_decay=0.1, foreach=False), STEPS, seed=4)
    assert_adam_close(_params(m1), _params(m2))
    n = 1000
    p, m, v, out = _init(n, 13), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    cpu_adam_step(p, _grad(n, 1, 14).bfloat16(), m, v, step=1, lr=LR, out16=out)
    assert torch.equal(out, p.bfloat16())


def test_odd_layouts_use_the_torch_path() -> None:
    w = torch.nn.Parameter(torch.randn(6, 5).t())  # non-contiguous
    ref = torch.nn.Parameter(w.detach().clone())
    o1 = CPUAdam([w], lr=1e-2, weight_decay=0.01)
    o2 = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    for s in range(1, 11):
        g = _grad(30, s, 15).view(5, 6)
        w.grad, ref.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert_adam_close(w.detach().flatten(), ref.detach().flatten())
    assert o1.state[w]["step"].item() == 10.0  # the torch path counts steps like the kernel does


def test_step_hooks_and_profiler_range_still_work() -> None:
    w = torch.nn.Parameter(torch.randn(8))
    w.grad = torch.randn(8)
    opt = CPUAdam([w])
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    handle = register_optimizer_step_post_hook(lambda o, a, k: seen.append("global"))
    try:
        opt.step()
    finally:
        handle.remove()
    assert seen == ["pre", "post", "global"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert "Optimizer.step#CPUAdam.step" in {e.key for e in prof.key_averages()}
    assert opt.state[w]["step"].item() == 2.0


def test_step_wrapper_bypassed_only_when_idle() -> None:
    from zoff.optim.cpu_adam import _step_wrapper_needed

    opt = CPUAdam([torch.nn.Parameter(torch.randn(4))])
    assert not _step_wrapper_needed(opt)
    handle = opt.register_step_pre_hook(lambda o, a, k: None)
    assert _step_wrapper_needed(opt)
    handle.remove()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _step_wrapper_needed(opt)


def test_float64_step_counter_from_torch_state() -> None:
    """torch's AdamW counts in float64 when the default dtype is float64; the kernel keeps that counter."""
    w = torch.nn.Parameter(torch.randn(64))
    opt = CPUAdam([w], lr=1e-2)
    opt.state[w] = {"step": torch.tensor(3.0, dtype=torch.float64), "exp_avg": torch.zeros(64),
                    "exp_avg_sq": torch.zeros(64)}  # fmt: skip
    w.grad = torch.randn(64)
    opt.step()
    assert opt.state[w]["step"].dtype == torch.float64 and opt.state[w]["step"].item() == 4.0


def test_sparse_grad_is_refused() -> None:
    w = torch.nn.Parameter(torch.randn(4))
    w.grad = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        CPUAdam([w]).step()


_BROKEN_BUILD_SCRIPT = textwrap.dedent(
    """
    import torch
    from zoff.optim import CPUAdam, backend_info
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(1000)); b = torch.nn.Parameter(a.detach().clone())
    o1 = CPUAdam([a], lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(100):
        g = torch.randn(1000)
        a.grad, b.grad = g.clone(), g.clone()
        o1.step(); o2.step()
    err = ((a - b).abs() / b.abs().clamp_min(1.0)).max().item()
    print("BACKEND", backend_info()["backend"], "ERR", err)
    """
)


def test_broken_build_prints_compiler_error_once_and_falls_back(tmp_path: Path) -> None:
    env = dict(os.environ, CXX="/nonexistent/c++", ZOFF_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("ZOFF_CPU_ADAM_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-c", _BROKEN_BUILD_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    backend, err = proc.stdout.split()[1], float(proc.stdout.split()[3])
    assert backend == "torch" and err < 1e-6
    assert proc.stderr.count("zoff: building the fused CPU Adam extension failed") == 1
    assert proc.stderr.count("ninja: build stopped") == 1  # the build log, printed once
    assert "/nonexistent/c++" in proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("zoff: warning:")]
    assert len(warnings) == 1 and "PyTorch fallback" in warnings[0]
    assert "AttributeError" not in proc.stderr
