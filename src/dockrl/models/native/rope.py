"""RoPE's forward and backward in C (rope.c), for models/decoder.py's `apply_rope` on a CPU.

The results are torch's bit for bit (elementwise, each value rounded where torch rounds it), so `apply_rope`
takes them wherever the native kernels load: torch's x * cos + roll(x) * signed_sin makes four passes over q
(and k), here one pass each way, in the same memory order as torch's (docs/benchmarks.md, "RMSNorm and RoPE
natively").
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dockrl.models import native


class RopeKernels:
    """rope.c's entry points over torch tensors: x [B, H, T, D] (any strides, a contiguous last dim), cos and
    signed_sin [B or 1, 1, T, D], one dtype, fp32 or bf16."""

    def __init__(self, kernels: dict[tuple[str, torch.dtype], Any]) -> None:
        self._kernels = kernels

    def fits(self, x: Tensor, cos: Tensor, sin: Tensor) -> bool:
        """Whether the kernels take these operands as they are (else apply_rope keeps torch's ops)."""
        return (
            x.device.type == "cpu"
            and x.dim() == 4
            and x.dtype == cos.dtype == sin.dtype
            and ("dockrl_rope_forward", x.dtype) in self._kernels
            and x.shape[-1] % 2 == 0
            and x.stride(-1) == 1
            and cos.shape == sin.shape
            and cos.dim() == 4
            and cos.shape[1] == 1
            and cos.shape[0] in (1, x.shape[0])
            and cos.shape[2:] == x.shape[2:]
            and cos.stride() == sin.stride()
            and cos.stride(-1) == 1
            and not any(isinstance(t, DTensor) for t in (x, cos, sin))
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x * cos + roll(x, D/2) * signed_sin, [B, H, T, D] as a view of a [B, T, H, D] contiguous tensor (the
        projection's order, which torch's ops would keep: rope.c's header)."""
        batch, heads, seq, dim = x.shape
        out = torch.empty((batch, seq, heads, dim), dtype=x.dtype)
        self._kernels["dockrl_rope_forward", x.dtype](
            x.data_ptr(), x.stride(0), x.stride(2), x.stride(1), *_angles(cos, sin), out.data_ptr(),
            batch, seq, heads, dim,
        )  # fmt: skip
        return out.transpose(1, 2)

    def backward(self, grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """d loss / d x for the forward's x, [B, H, T, D] as a view of a [B, T, H, D] contiguous tensor."""
        batch, heads, seq, dim = grad.shape
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        dx = torch.empty((batch, seq, heads, dim), dtype=grad.dtype)
        self._kernels["dockrl_rope_backward", grad.dtype](
            grad.data_ptr(), grad.stride(0), grad.stride(1), grad.stride(2), *_angles(cos, sin), dx.data_ptr(),
            batch, seq, heads, dim,
        )  # fmt: skip
        return dx.transpose(1, 2)


def _angles(cos: Tensor, sin: Tensor) -> tuple[int, int, int, int]:
    """cos and signed_sin's pointers and (row, token) strides; one set for every row: a row stride of 0."""
    return cos.data_ptr(), sin.data_ptr(), 0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(2)


@functools.cache  # one object: whether the kernels load is settled at the first call
def rope_kernels() -> RopeKernels | None:
    """RoPE's native kernels where they load (native.available(); DOCKRL_NATIVE=off: never), else None."""
    kernels = native._load()
    return None if kernels is None else RopeKernels(kernels)
