"""The fused LM head's softmax work in C (head.c), for dockrl.algos.head_logprobs on a CPU.

`head_kernels()` gives a `HeadKernels` (the protocol dockrl.algos.head_logprobs declares: algos cannot import
models, so the engine that holds both passes it in) where the native kernels load, else None. Per chunk of c
tokens the head then makes, besides its matmuls, one pass over the matmul's own [c, Vl] output for the forward's
maximum, one for its sums and one for the backward's d loss / d z, written in the logits' place, instead of torch's
~10 passes over an fp32 copy (docs/benchmarks.md, "The update's fixed costs"). What the values are and how
they round: head.c's header.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dockrl.models import native


class HeadKernels:
    """head.c's entry points over torch tensors (CPU, fp32 or bf16 logits with a contiguous last dim)."""

    def __init__(self, kernels: dict[tuple[str, torch.dtype], Any]) -> None:
        self._kernels = kernels

    def _kernel(self, name: str, z: Tensor) -> Any:
        if z.device.type != "cpu" or z.dim() != 2 or z.stride(1) != 1:
            raise ValueError(f"head kernels need CPU logits [c, V] with a contiguous last dim; got {z.shape}")
        try:
            return self._kernels[name, z.dtype]
        except KeyError:
            raise ValueError(f"head kernels take fp32 or bf16 logits; got {z.dtype}") from None

    def peak(self, z: Tensor, temperature: float) -> Tensor:
        """max_j z[r, j] / temperature, fp32 [c]."""
        out = torch.empty(z.shape[0])
        self._kernel("dockrl_head_max", z)(
            z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), temperature, out.data_ptr()
        )
        return out

    def sums(self, z: Tensor, temperature: float, peak: Tensor) -> tuple[Tensor, Tensor]:
        """(sum_j e^(x_j - peak), sum_j e^(x_j - peak) (x_j - peak)) fp32 [c] each, x = z / temperature."""
        peak = peak.float().contiguous()
        sum_exp, weighted = torch.empty(z.shape[0]), torch.empty(z.shape[0])
        self._kernel("dockrl_head_sums", z)(
            z.data_ptr(),
            z.shape[0],
            z.shape[1],
            z.stride(0),
            temperature,
            peak.data_ptr(),
            sum_exp.data_ptr(),
            weighted.data_ptr(),
        )
        return sum_exp, weighted

    def grad_(
        self,
        z: Tensor,
        temperature: float,
        lse: Tensor,
        mean_z: Tensor,
        grad_entropy: Tensor | None,
        grad_logp: Tensor | None,
        ids: Tensor,
    ) -> Tensor:
        """d loss / d z [c, V] in z's dtype, written over z (returned): for each row, -p_j coef / T plus the
        scored ids' gradients / T, p = softmax(z / T), coef = (z_j / T - mean_z) g_entropy + sum_i g_logp_i.
        `ids` [c, m] are local ids of the scored tokens (-1: not in this rank's slice), `grad_logp` [c, m]."""
        kernel = self._kernel("dockrl_head_grad", z)
        rows = z.shape[0]
        lse, mean_z = lse.float().contiguous(), mean_z.float().contiguous()
        entropy = None if grad_entropy is None else grad_entropy.float().contiguous()
        total = ids_ = g_ids = z_ids = None  # (locals: alive while the kernel reads them)
        if grad_logp is not None:
            g_ids = grad_logp.float().contiguous()
            total = g_ids.sum(-1)
            ids_ = ids.long().contiguous()
            z_ids = z.gather(-1, ids_.clamp(min=0)).float()  # before dz overwrites them
        kernel(
            z.data_ptr(),
            rows,
            z.shape[1],
            z.stride(0),
            temperature,
            lse.data_ptr(),
            mean_z.data_ptr(),
            _pointer(entropy),
            _pointer(total),
            _pointer(ids_),
            _pointer(g_ids),
            _pointer(z_ids),
            0 if ids_ is None else ids_.shape[1],
            z.data_ptr(),
            z.stride(0),
        )
        return z

    def accumulate_(self, dst: Tensor, src: Tensor) -> None:
        """dst (fp32, contiguous) += src (fp32 or bf16, contiguous, dst's shape)."""
        if dst.dtype != torch.float32 or not dst.is_contiguous() or src.shape != dst.shape:
            raise ValueError("accumulate_ needs a contiguous fp32 dst of src's shape")
        src = src.contiguous()
        kernel = self._kernels.get(("dockrl_head_accumulate", src.dtype))
        if kernel is None:
            raise ValueError(f"accumulate_ takes fp32 or bf16; got {src.dtype}")
        kernel(dst.data_ptr(), src.data_ptr(), src.numel())


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def head_kernels() -> HeadKernels | None:
    """The head's native kernels where they load (native.available(); DOCKRL_NATIVE=off: never), else None."""
    kernels = native._load()
    return None if kernels is None else HeadKernels(kernels)
