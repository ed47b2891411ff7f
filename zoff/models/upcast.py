"""train.cpu_precision=upcast: a 16-bit model computed in fp32 on the CPU, its parameters and gradients kept in
their 16-bit storage.

Why: on a CPU without bf16/fp16 matmul kernels (zoff.host.kernels), torch runs a 16-bit matmul with its
reference kernel, 50-140x slower than fp32. `cpu_precision=fp32` makes the whole run fp32: parameters and
gradients too, 4 B each where the configured run keeps 2, so every gather, gradient reduction and parameter
file moves twice the bytes. `upcast` keeps the configured storage (shards, gathered blocks, gradients, files
on disk and every memory figure but the activations are the 16-bit run's) and runs each module's arithmetic in
fp32: activations are fp32 from the embedding on; a Linear multiplies by its weight upcast for that product;
a LayerNorm/RMSNorm normalises with its weights upcast.

What it costs: a weight's fp32 copy exists for one product at a time, in forward and again in backward (the
Linear's autograd node keeps the 16-bit parameter, not the copy, so stage 3's gathered blocks are released
as in the 16-bit run); the activations are fp32, twice a 16-bit run's (the estimate counts them so).

Its numbers: each module's output is what fp32 computes from the 16-bit weights, and each weight's gradient
is computed in fp32 and rounded to the parameter's dtype where autograd lands it, per use (a tied weight's two
uses add in 16 bits, as a 16-bit PyTorch model's do). Neither fp32's numbers nor the 16-bit kernels': named
and opt-in.

Which modules: nn.Linear, nn.Embedding, nn.LayerNorm and nn.RMSNorm are computed this way; a module whose
parameters are all one-dimensional (a model's own RMSNorm scale, a bias) computes in fp32 by torch's type
promotion (an fp32 activation times a 16-bit weight is fp32); any other module holding a parameter of two or
more dimensions is refused at start-up, by name (its forward would meet an fp32 activation with a 16-bit
weight in a matmul).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from zoff.errors import UserError


class _Linear32(torch.autograd.Function):
    """F.linear(x, weight, bias) computed in fp32; backward keeps the 16-bit weight (not its fp32 copy) and
    upcasts it again. The products and sums are the ones autograd's linear takes (addmm's backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight.float(), None if bias is None else bias.float())

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        gx = g.matmul(weight.float()) if need_x else None
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype) if need_w else None
        gb = g2.sum(0).to(bias.dtype) if bias is not None and need_b else None
        return gx, gw, gb


class _Embedding32(torch.autograd.Function):
    """F.embedding(idx, weight) as fp32 rows; the weight's gradient is summed in fp32 over the rows that used
    it, then rounded once to the weight's dtype. (A gather then an upcast is exactly the upcast weight's rows.)"""

    @staticmethod
    def forward(ctx, idx: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.rows, ctx.dtype, ctx.padding_idx = weight.shape[0], weight.dtype, padding_idx
        return F.embedding(idx, weight, padding_idx).float()

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        (idx,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        gw = torch.ops.aten.embedding_dense_backward(g.float(), idx, ctx.rows, pad, False)
        return None, gw.to(ctx.dtype), None


def _linear_forward(m: nn.Linear) -> Callable:
    # always fp32, whatever the activation's dtype (a model may cast its hidden states back to its own dtype)
    return lambda x: _Linear32.apply(x, m.weight, m.bias)


def _embedding_forward(m: nn.Embedding) -> Callable:
    return lambda idx: _Embedding32.apply(idx, m.weight, m.padding_idx)


def _layer_norm_forward(m: nn.LayerNorm) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = None if m.weight is None else m.weight.float()
        b = None if m.bias is None else m.bias.float()
        return F.layer_norm(x.float(), m.normalized_shape, w, b, m.eps)

    return forward


def _rms_norm_forward(m: nn.RMSNorm) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = None if m.weight is None else m.weight.float()
        return F.rms_norm(x.float(), m.normalized_shape, w, m.eps)

    return forward


FORWARDS: dict[type, Callable[[nn.Module], Callable]] = {
    nn.Linear: _linear_forward,
    nn.Embedding: _embedding_forward,
    nn.LayerNorm: _layer_norm_forward,
    nn.RMSNorm: _rms_norm_forward,
}


def is_upcast(module: nn.Module) -> bool:
    """Whether upcast_compute replaced `module`'s forward (the tiled loss asks this of the output head)."""
    return getattr(module.forward, "zoff_upcast", False) is True


def refusal(model: nn.Module) -> str | None:
    """Why `model` cannot be upcast (the first module that stops it, by name), or None."""
    for name, m in model.named_modules():
        if type(m) in FORWARDS:
            if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
                return f"{name} (nn.Embedding with max_norm, scale_grad_by_freq or sparse)"
            continue
        wide = [n for n, p in m.named_parameters(recurse=False) if p.dim() >= 2]
        if wide:
            return (
                f"{name or 'the model'} ({type(m).__name__}) holds the {wide[0]!r} parameter of "
                f"{m.get_parameter(wide[0]).dim()} dimensions, used by a forward zoff cannot compute in fp32"
            )
    return None


def upcast_compute(model: nn.Module) -> int:
    """Make every module of `model` compute in fp32 over its 16-bit parameters (the module docstring); the
    number of modules whose forward was replaced. Raises UserError naming a module it cannot handle."""
    why = refusal(model)
    if why is not None:
        raise UserError(f"train.cpu_precision=upcast: {why}; use train.cpu_precision=fp32 for this model")
    count = 0
    for m in model.modules():
        make = FORWARDS.get(type(m))
        if make is not None:
            m.forward = make(m)
            m.forward.zoff_upcast = True  # (is_upcast)
            count += 1
    return count
