"""Pure-PyTorch twin of the fused CPU Adam kernel: the test oracle and the fallback when the build fails.

Same signature and in-place semantics as :func:`zoff.optim.cpu_adam.cpu_adam_step`. With bias correction on,
it runs torch's fused CPU Adam(W) kernel (one pass over memory, correctly rounded sqrt, the same float operation
order as zoff's kernel); otherwise, or where that kernel is missing, the single-tensor formula of
torch.optim.Adam(W)(foreach=False), op for op. A 16-bit gradient costs an extra upcast pass here and the 16-bit
copy an extra pass afterwards: that is the price of the fallback.
"""

from __future__ import annotations

import torch

__all__ = ["adam_step_reference"]

_HAS_FUSED = hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_adam_")


def adam_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    out16: torch.Tensor | None = None,
    threads: int | None = None,
    simd: str | None = None,
) -> None:
    """One in-place Adam(W) step with torch ops; ``out16`` (if given) receives ``param.to(out16.dtype)``.

    ``threads`` and ``simd`` are accepted for signature compatibility and ignored: torch ops use torch's own
    intra-op thread count, which the caller controls with torch.set_num_threads.
    """
    del threads, simd
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this update), got {step}")
    lr, beta1, beta2, eps, weight_decay = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    with torch.no_grad():
        if grad.dtype != param.dtype:
            grad = grad.to(param.dtype)  # torch's kernels want matching dtypes: one extra pass
        tensors = (param, grad, exp_avg, exp_avg_sq)
        # torch's fused CPU kernel walks raw memory: contiguous same-shape tensors only.
        fusable = all(
            t.device.type == "cpu" and t.is_contiguous() and t.shape == param.shape for t in tensors
        )
        if bias_correction and _HAS_FUSED and fusable:
            fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
            step_t = [torch.tensor(float(step), dtype=torch.float32)]
            fused(
                [param], [grad], [exp_avg], [exp_avg_sq], [], step_t, lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
            )  # fmt: skip
        else:
            _single_tensor_step(
                param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                bias_correction,
            )  # fmt: skip
        if out16 is not None:
            out16.copy_(param.reshape(out16.shape))


def _single_tensor_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
    bias_correction: bool,
) -> None:  # fmt: skip
    """torch.optim.adam._single_tensor_adam's op sequence (non-capturable, no amsgrad), scalars in double."""
    if weight_decay != 0:
        if adamw_mode:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step) if bias_correction else 1.0
    bias_correction2 = 1 - beta2 ** float(step) if bias_correction else 1.0
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
