"""RMSNorm's forward and backward in C (norm.c), for models/rms_norm.py on a CPU.

`norm_kernels()` gives a `NormKernels` where the native kernels load, else None; models/rms_norm.py's RMSNorm
computes with it by default on a CPU, so every forward of dockrl's engines there (update, reference, old
log-probs, a rollout's prefill) computes the norms the same way. Per norm the forward is one pass over x and
the backward one over x and the incoming gradient, instead of torch's ~4 and ~9 passes through fp32 copies
(docs/benchmarks.md, "RMSNorm and RoPE natively"). What the values are and how they round: norm.c's header
(torch's ops one by one, the sums in another order).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dockrl.models import native


class NormKernels:
    """norm.c's entry points over torch tensors: x [..., H] and the weight [H] of one dtype, fp32 or bf16."""

    def __init__(self, kernels: dict[tuple[str, torch.dtype], Any]) -> None:
        self._kernels = kernels

    def fits(self, x: Tensor, weight: Tensor) -> bool:
        """Whether the kernels take x and the weight as they are: plain CPU tensors (not a DTensor: a
        tensor-parallel or still-sharded weight keeps torch's ops) of one dtype the kernels have, the weight
        contiguous of x's last size."""
        return (
            x.device.type == "cpu"
            and x.dtype == weight.dtype
            and ("dockrl_rms_norm_forward", x.dtype) in self._kernels
            and not isinstance(x, DTensor)
            and not isinstance(weight, DTensor)
            and weight.dim() == 1
            and weight.shape[0] == x.shape[-1]
            and weight.is_contiguous()
        )

    def forward(self, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """(weight * RMS-normalized x, x's shape and dtype; the per-row 1 / rms, fp32 [rows])."""
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype)
        rstd = torch.empty(rows.shape[0])
        self._kernels["dockrl_rms_norm_forward", x.dtype](
            rows.data_ptr(),
            rows.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            rstd.data_ptr(),
            rows.shape[0],
            rows.shape[1],
            eps,
        )
        return out.view(x.shape), rstd

    def backward(
        self, x: Tensor, weight: Tensor, rstd: Tensor, grad: Tensor, need_x: bool, need_weight: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """(d loss / d x in x's shape and dtype, d loss / d weight in its dtype), each None where not asked for."""
        rows, grad_rows = _rows(x), _rows(grad.to(x.dtype))
        grad_x = torch.empty(rows.shape, dtype=x.dtype) if need_x else None
        grad_weight = torch.empty(weight.shape, dtype=weight.dtype) if need_weight else None
        failed = self._kernels["dockrl_rms_norm_backward", x.dtype](
            rows.data_ptr(),
            rows.stride(0),
            weight.data_ptr(),
            rstd.data_ptr(),
            grad_rows.data_ptr(),
            grad_rows.stride(0),
            None if grad_x is None else grad_x.data_ptr(),
            rows.shape[1],
            None if grad_weight is None else grad_weight.data_ptr(),
            rows.shape[0],
            rows.shape[1],
        )
        if failed:
            raise MemoryError("rms_norm_backward: the weight gradient's scratch could not be allocated")
        return (None if grad_x is None else grad_x.view(x.shape)), grad_weight


def _rows(t: Tensor) -> Tensor:
    """t as [rows, H] with a contiguous last dim (a view where t's layout allows, else a copy)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@functools.cache  # one object: whether the kernels load is settled at the first call
def norm_kernels() -> NormKernels | None:
    """The norms' native kernels where they load (native.available(); DOCKRL_NATIVE=off: never), else None."""
    kernels = native._load()
    return None if kernels is None else NormKernels(kernels)
