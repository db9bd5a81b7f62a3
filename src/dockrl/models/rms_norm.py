"""RMSNorm as Hugging Face computes it: the decoder's (models/decoder.py), the vision tower's (models/vision.py)
and tensor parallelism's per-head q/k norm (parallel/tensor_parallel.py).

The forward is Hugging Face's, op for op (the same output bits): y = (x_f32 * r).to(x.dtype), r = rsqrt(mean(x_f32^2)
+ eps), out = weight * y. Its backward is written out (`_RMSNormFunction`) instead of left to autograd, which
keeps the fp32 copy of x and y for it (4H + 2eH bytes per token, e the compute dtype's size) and walks the
graph's ~13 elementwise passes; here the backward keeps only x in its own dtype and r (eH + 4 bytes) and makes
11 passes, y recomputed when the weight needs its gradient:

    g_y = (g * weight) in x's dtype, then fp32     (autograd rounds the same product the same way)
    g_x = r * g_y - x * r^3 * mean(g_y * x)        (fp32, one rounding to x's dtype at the end)
    g_weight = sum over tokens of g * y

With bf16 activations that halves what a norm keeps for the backward (8H -> 4H bytes per token: two norms a
layer, ~13% of a layer's saved activations at Qwen2.5-7B's shape) and takes a norm's forward and backward 1.3x
faster on a CPU (`dockrl bench kernels`). The gradients are autograd's up to fp32 reassociation, at most one unit
in the last place of x's dtype apart (tests/unit/test_rms_norm.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMS-normalized x, x [..., dim], weight [dim] (module docstring). Without a gradient to compute (a
    rollout's decode, a reference pass) the forward runs as it is: an autograd Function's call costs ~6 us more
    per norm, ~2% of a small model's decode step."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps)
    return _forward(x, weight, eps)[0]


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape and dtype."""
        return rms_norm(x, self.weight, self.eps)


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
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            y = (x * rstd).to(x.dtype)  # x * rstd computes in fp32 (rstd's dtype): the forward's y
            grad_weight = (grad * y).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_y = (grad * weight).float()  # a tensor of its own: updated in place below
            scale = (grad_y * x).sum(-1, keepdim=True).mul_(rstd.pow(3)).div_(x.shape[-1])  # [..., 1]
            grad_x = grad_y.mul_(rstd).addcmul_(x, scale, value=-1).to(x.dtype)
        return grad_x, grad_weight, None
