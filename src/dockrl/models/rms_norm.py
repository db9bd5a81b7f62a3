"""RMSNorm as Hugging Face computes it: the decoder's (models/decoder.py), the vision tower's (models/vision.py)
and tensor parallelism's per-head q/k norm (parallel/tensor_parallel.py).

The forward is Hugging Face's, op for op (the same output bits): y = (x_f32 * r).to(x.dtype), r = rsqrt(mean(x_f32^2)
+ eps), out = weight * y. Its backward is written out (`_RMSNormFunction`) instead of left to autograd, which
keeps the fp32 copy of x and y for it (4H + 2eH bytes per token, e the compute dtype's size) and walks the
graph's ~13 elementwise passes; here the backward keeps only x in its own dtype and r (eH + 4 bytes per token)
and makes 9, with p = g * x in fp32 (exact: a product of two bf16 values fits fp32's mantissa) serving both sums:

    g_weight = p^T r                               (one matrix-vector product over the tokens)
    g_x = r * g_y - x * r^3 * (p @ weight) / H     (fp32; g_y = (g * weight) rounded to x's dtype as autograd
                                                   rounds it; one rounding to x's dtype at the end)

Against autograd the sums skip two roundings to bf16 (of y, and of g * weight inside the mean), so the
gradients are as close to the exact ones or closer: tests/unit/test_rms_norm.py bounds both against float64.
With bf16 activations a norm keeps half as much for the backward (8H -> 4H bytes per token: two norms a layer,
~13% of a layer's saved activations at Qwen2.5-7B's shape), and its forward and backward run 1.3-1.7x faster on
a CPU (bf16, one thread; the e2e bench's micro-batch 28 x 143 x 256: 11.0 -> 6.4 ms; 6,899 x 128: 8.0 -> 5.5
ms; 4 x 512 x 256: 4.1 -> 3.1 ms; medians of 21 interleaved runs, Intel Xeon with AMX, 2026-12-05).

On a CPU where the native kernels load (models/native/norm.py; DOCKRL_NATIVE=off: never) a norm computes with
them instead: the same ops in one pass each for the forward and the backward, the sums in another order, so
every forward of dockrl's engines on a CPU (the update, reference and old log-prob passes, a rollout's prefill,
a replica's) computes the norms the same way, within fp32 accumulation of Hugging Face's rather than its bits
(tests/unit/test_rms_norm.py). `use_norm_kernels(model, None)` keeps torch's ops for a model (as above: Hugging
Face's bits); operands the kernels do not take (a DTensor, x and the weight in two dtypes) keep them too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from dockrl.models.native.norm import NormKernels, norm_kernels

AUTO = "auto"  # RMSNorm.kernels: the native kernels where they load (the module docstring)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: NormKernels | None = None
) -> torch.Tensor:
    """weight * RMS-normalized x, x [..., dim], weight [dim] (module docstring): with `kernels` where they take
    x and the weight, else torch's ops. Without a gradient to compute (a rollout's decode, a reference pass)
    the forward runs as it is: an autograd Function's call costs ~6 us more per norm, ~2% of a small model's
    decode step."""
    native = kernels if kernels is not None and kernels.fits(x, weight) else None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        if native is not None:
            return _NativeRMSNormFunction.apply(x, weight, eps, native)
        return _RMSNormFunction.apply(x, weight, eps)
    return _forward(x, weight, eps)[0] if native is None else native.forward(x, weight, eps)[0]


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's forward: the output, and the rsqrt [..., 1] (fp32) the backward needs."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight multiply (Hugging Face order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # the native kernels (AUTO: where they load; use_norm_kernels sets them), None: torch's ops
        self.kernels: NormKernels | None | str = AUTO

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape and dtype."""
        kernels = self.kernels
        if kernels is AUTO:  # the native library is loaded (built, the first time) for CPU tensors only
            kernels = norm_kernels() if x.device.type == "cpu" else None
        return rms_norm(x, self.weight, self.eps, kernels if isinstance(kernels, NormKernels) else None)


def use_norm_kernels(model: nn.Module, kernels: NormKernels | None | str) -> None:
    """Every RMSNorm of `model` computes with `kernels` (None: torch's ops; AUTO: the native ones where they
    load, the default)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernels = kernels


class _RMSNormFunction(torch.autograd.Function):
    """The forward and the backward of the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        rows_x, rows_grad, rows_rstd = x.reshape(-1, dim), grad.reshape(-1, dim), rstd.reshape(-1, 1)
        product = rows_grad.float() * rows_x  # [T, H] fp32 (exact for bf16 inputs)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            # matrix-vector products (mv): reductions, not matmul work (bench/roofline.py counts none)
            grad_weight = torch.mv(product.t(), rows_rstd.view(-1)).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            scale = torch.mv(product, weight.float())[:, None].mul_(rows_rstd.pow(3)).div_(dim)  # [T, 1]
            grad_y = (rows_grad * weight).float()  # a tensor of its own: updated in place
            grad_x = grad_y.mul_(rows_rstd).addcmul_(rows_x, scale, value=-1).to(x.dtype).reshape(x.shape)
        return grad_x, grad_weight, None


class _NativeRMSNormFunction(torch.autograd.Function):
    """The forward and backward of `_RMSNormFunction` in norm.c (the module docstring); keeps the same tensors."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: NormKernels
    ) -> torch.Tensor:
        out, rstd = kernels.forward(x, weight, eps)
        ctx.kernels = kernels
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = ctx.kernels.backward(
            x, weight, rstd, grad, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        return grad_x, grad_weight, None, None
