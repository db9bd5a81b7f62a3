"""Swap tensors' storage to host memory and back, in place (views and parameters stay valid).

Lifecycle: `offload(tensors)` copies each distinct storage to a host twin (pinned on CUDA) and resizes
the device storage to 0 bytes; `onload()` resizes it back and copies the twin in, bit for bit. Every view
of a storage (FSDP2 shards, optimizer state, tied weights) sees its old bytes again; no Python object changes.

On CPU there is no device memory to free, so by default nothing moves and only the bookkeeping runs (the
same code path); `host_copy=True` forces the copy-and-free on CPU too, which is how the tests exercise it.
Storages that cannot be resized (file-mapped tensors) are left in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes (a DTensor's local shard, a parameter's data)."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class HostSwap:
    """One set of swapped-out storages (see module docstring); offload and onload alternate."""

    def __init__(self, name: str, *, host_copy: bool | None = None) -> None:
        self.name = name
        self.host_copy = host_copy
        self._swapped: list[tuple[torch.UntypedStorage, torch.device, torch.Tensor]] = []
        self.offloaded = False

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the storages of `tensors` to host memory; returns the device bytes freed."""
        assert not self.offloaded, f"{self.name}: offload twice without onload"
        seen: set[int] = set()
        freed = 0
        for tensor in tensors:
            local = local_tensor(tensor)
            storage = local.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            move = local.device.type != "cpu" if self.host_copy is None else self.host_copy
            # A storage borrowed from a file mapping (an unsharded CPU model loaded from safetensors)
            # cannot be resized; it stays where it is.
            if not move or not storage.resizable():
                continue
            device = local.device
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device.type == "cuda")
            host.copy_(_byte_view(storage, device), non_blocking=device.type == "cuda")
            self._swapped.append((storage, device, host))
            freed += storage.nbytes()
        if any(device.type == "cuda" for _, device, _ in self._swapped):
            torch.cuda.synchronize()
        for storage, _, _ in self._swapped:
            storage.resize_(0)
        self.offloaded = True
        return freed

    def onload(self) -> None:
        """Bring every swapped storage back to its device with its exact bytes."""
        assert self.offloaded, f"{self.name}: onload without offload"
        for storage, device, host in self._swapped:
            storage.resize_(host.numel())
            _byte_view(storage, device).copy_(host, non_blocking=device.type == "cuda")
        if any(device.type == "cuda" for _, device, _ in self._swapped):
            torch.cuda.synchronize()
        self._swapped = []
        self.offloaded = False
