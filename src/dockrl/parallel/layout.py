"""Layouts of the actor's weights: which slice of which parameter a rank holds, in training and inference.

Training layout (dp, tp_train): rank r is (dp_rank, tp_rank) = (r // tp_train, r % tp_train); a split
parameter (`dockrl.models.tp_plan.shard_dim`) is cut in tp_train slices, and FSDP2 shards each slice over dp.
Inference layout (replicas, tp_infer): rank r serves replica r // tp_infer as tp rank r % tp_infer and holds
slice r % tp_infer of every split parameter, whole replicated ones.

Expert parallelism (MoE, actor.ep): the dp ranks form an (edp, ep) grid, dp_rank = edp_rank x ep + ep_rank. An
expert parameter ([E, ...]) is split over ep along dim 0 (rank e holds experts [e E/ep, (e+1) E/ep)), and FSDP2
shards each slice over the edp ranks; every other parameter is laid out as above. `Placement` names both
steps for one parameter, whichever kind it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dockrl.models.tp_plan import shard_dim, shard_range


@dataclass(frozen=True)
class Placement:
    """Where this rank's block of one training parameter lies in the whole tensor: slice `rank` of `size`
    along `dim` (tensor-parallel, or expert-parallel for experts; None = whole), then FSDP2's rows
    `fsdp_rank` of `fsdp_size` of that slice (torch.chunk sizes)."""

    dim: int | None
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    fsdp_rank: int = 0
    fsdp_size: int = 1
    fsdp_group: dist.ProcessGroup | None = None

    def slice_rows(self, shape: tuple[int, ...]) -> int:
        """Rows (dim 0) of this rank's slice, the dim FSDP2 shards."""
        return shape[0] // self.size if self.dim == 0 else shape[0]


@dataclass(frozen=True)
class Layout:
    """A (replica/dp, tp) grid over `world` ranks; tp ranks are contiguous."""

    world: int
    tp: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world % self.tp:
            raise ValueError(f"tensor-parallel size {self.tp} does not divide the world size {self.world}")

    @property
    def groups(self) -> int:
        """Number of tp groups (dp ranks in training, replicas in inference)."""
        return self.world // self.tp

    def tp_rank(self, rank: int) -> int:
        """Position of `rank` inside its tp group."""
        return rank % self.tp

    def shard_slice(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[int | None, int, int]:
        """(dim, start, end) of `rank`'s slice of parameter `name` with full `shape`; dim None = whole."""
        dim = shard_dim(name) if self.tp > 1 else None
        if dim is None:
            return None, 0, shape[0] if shape else 1
        start, end = shard_range(shape[dim], self.tp_rank(rank), self.tp)
        return dim, start, end

    def shard_shape(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        """Shape of `rank`'s slice of parameter `name`."""
        dim, start, end = self.shard_slice(name, shape, rank)
        if dim is None:
            return tuple(shape)
        return tuple(end - start if d == dim else s for d, s in enumerate(shape))


def full_tensor(tensor: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The whole parameter from this rank's training shard (collective over the FSDP2 ranks, then over the
    ranks of the tensor- or expert-parallel split)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if placement.dim is None or placement.size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(placement.size)]
    dist.all_gather(parts, tensor.contiguous(), group=placement.group)
    return torch.cat(parts, dim=placement.dim)
