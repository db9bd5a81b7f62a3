"""Cells on the wire: tensors and arrays travel sealed, so the dock's actors store bytes they never decode.

```
 producer client: seal(cell) --> Sealed(kind, dtype, shape, bytearray) --frame--> warehouse stores it as is
 consumer client: <--frame-- warehouse hands it back --> unseal(Sealed) -> torch.Tensor / np.ndarray
```

Why: a torch tensor pickled as itself makes every process that unpickles it import torch (seconds of CPU)
and rebuild a storage (150-250 us per tensor). A warehouse only stores and returns payload, so it gets the raw
buffer and a three-field header instead: it imports no torch and decodes nothing, and the producer and the
consumer pay one buffer copy each. Other values (labels, floats, strings, lists) pass through unchanged.

A Sealed cell's buffer is a bytearray, so the tensor or array a consumer gets is writable and shares the
buffer it arrived in (no second copy). Tensors on another device than the CPU and arrays of Python objects
are not sealed (they pickle as themselves, as before). No torch import at module level: torch is found in
sys.modules when a tensor is sealed and imported when one is unsealed.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

TENSOR, ARRAY = "tensor", "array"


class Sealed:
    """One cell's bytes and what it was: kind (TENSOR or ARRAY), dtype name, shape, data (a bytearray)."""

    __slots__ = ("kind", "dtype", "shape", "data")

    def __init__(self, kind: str, dtype: str, shape: tuple[int, ...], data: bytearray) -> None:
        self.kind, self.dtype, self.shape, self.data = kind, dtype, shape, data

    @property
    def nbytes(self) -> int:
        """Bytes of the payload (what payload_nbytes counts for the decoded cell too)."""
        return len(self.data)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __reduce__(self):
        return Sealed, (self.kind, self.dtype, self.shape, self.data)


def seal(value: Any) -> Any:
    """`value` as a Sealed cell if it is a CPU tensor or a numeric numpy array, else `value` itself."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or value.is_quantized:
            return value
        flat = value.detach().contiguous().reshape(-1)
        # As bytes, so dtypes numpy lacks (bf16) seal the same way; an empty tensor has no bytes to view.
        data = bytearray(memoryview(flat.view(torch.uint8).numpy())) if flat.numel() else bytearray()
        return Sealed(TENSOR, str(value.dtype).removeprefix("torch."), tuple(value.shape), data)
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        data = bytearray(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
        return Sealed(ARRAY, value.dtype.str, value.shape, data)
    return value


def unseal(value: Any) -> Any:
    """The tensor or array a Sealed cell holds (writable, sharing its buffer); any other value unchanged."""
    if not isinstance(value, Sealed):
        return value
    if value.kind == ARRAY:
        return np.frombuffer(value.data, dtype=np.dtype(value.dtype)).reshape(value.shape)
    import torch

    dtype = getattr(torch, value.dtype)
    if not value.data:
        return torch.empty(value.shape, dtype=dtype)
    return torch.frombuffer(value.data, dtype=torch.uint8).view(dtype).reshape(value.shape)


def seal_batch(batch: dict[str, list]) -> dict[str, list]:
    """Every cell of a put sealed; a value repeated across rows (a group's prompt) is sealed once and stays
    one shared object, so the frame carries it once (pickle's memo)."""
    sealed: dict[int, Any] = {}
    return {
        column: [sealed[id(v)] if id(v) in sealed else sealed.setdefault(id(v), seal(v)) for v in values]
        for column, values in batch.items()
    }


def unseal_batch(batch: dict[str, list]) -> dict[str, list]:
    """Every cell of a get unsealed; cells that arrived as one shared object stay one object."""
    opened: dict[int, Any] = {}
    return {
        column: [opened[id(v)] if id(v) in opened else opened.setdefault(id(v), unseal(v)) for v in values]
        for column, values in batch.items()
    }
