"""The one mapping from a precision setting (run.precision, after `auto` is resolved) to a torch dtype."""

from __future__ import annotations

import torch


def dtype_of(precision: str) -> torch.dtype:
    """torch.bfloat16 for "bf16", torch.float32 for "fp32" (anything else is a ValueError naming it)."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp32":
        return torch.float32
    raise ValueError(
        f"precision {precision!r} is neither 'bf16' nor 'fp32' (run.precision is resolved first)"
    )
