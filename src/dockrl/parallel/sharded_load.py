"""Shard-sized loading: each rank reads only its own slices of a Hugging Face checkpoint.

    build on meta ─▶ tensor-parallel split (meta) ─▶ fully_shard over dp (meta) ─▶ to_empty(device)
      ─▶ for each parameter: this rank's block of the checkpoint tensor ─▶ cast ─▶ copy into the local shard

A parameter's block in the checkpoint is the composition of the two layouts (`parallel.layout.Placement`):
- tensor parallel (`models.tp_plan`): rank t of tp holds slice t of the split dim (0 or 1), whole otherwise;
  an expert parameter under expert parallelism: rank e of ep holds experts slice e (dim 0);
- FSDP2: rank d of the FSDP ranks (dp, or edp for experts) holds rows [d * c, min((d + 1) * c, n)) of that
  slice, c = ceil(n / size) (torch.chunk).
So every rank reads about 1/(dp x tp) of each tensor; no rank ever holds a whole tensor, let alone the model.
Tensors the checkpoint lacks come from `fallback` (e.g. the fresh value head of PPO's critic).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dockrl.models.hf import CheckpointReader, check_shapes
from dockrl.models.tp_plan import shard_range
from dockrl.parallel.layout import Placement


def fsdp_rows(num_rows: int, dp_rank: int, dp: int) -> tuple[int, int]:
    """[start, end) of the rows FSDP2 gives `dp_rank` of a dim of `num_rows` (torch.chunk semantics)."""
    chunk = -(-num_rows // dp) if num_rows else 0
    start = min(num_rows, dp_rank * chunk)
    return start, min(num_rows, start + chunk)


def checkpoint_block(global_shape: tuple[int, ...], placement: Placement) -> tuple[slice, ...]:
    """The block of a checkpoint tensor of `global_shape` that a rank holds at `placement`, one slice per dim."""
    block = [slice(0, size) for size in global_shape]
    dim = placement.dim if placement.size > 1 else None
    if dim is not None:
        start, end = shard_range(global_shape[dim], placement.rank, placement.size)
        block[dim] = slice(start, end)
    if placement.fsdp_size > 1 and global_shape:
        rows = block[0].stop - block[0].start
        start, end = fsdp_rows(rows, placement.fsdp_rank, placement.fsdp_size)
        block[0] = slice(block[0].start + start, block[0].start + end)
    return tuple(block)


def load_sharded(
    model: nn.Module,
    reader: CheckpointReader,
    global_shapes: Mapping[str, tuple[int, ...]],
    placement: Callable[[str], Placement] = lambda name: Placement(None),
    *,
    ignore: Callable[[str], bool] = lambda name: False,
    fallback: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Fill the parameters of `model` (materialised with `to_empty`, possibly split and sharded) with this
    rank's blocks of the checkpoint. `global_shapes`: every parameter's unsplit shape (from the meta model
    before splitting); `placement(name)`: where this rank's block lies (TrainEngine.placement); `ignore(name)`: checkpoint tensors the model does not have; `fallback`: whole tensors
    for parameters the checkpoint lacks. Errors name the checkpoint and the mismatched tensors."""
    fallback = dict(fallback or {})
    found = {n: reader.shapes[n] for n in reader.names() if not ignore(n)}
    found.update({n: tuple(t.shape) for n, t in fallback.items() if n not in found})
    check_shapes(global_shapes, found, reader.path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            block = checkpoint_block(global_shapes[name], placement(name))
            if name in reader.shapes and not ignore(name):
                value = reader.read(name, block) if local.numel() else None
            else:
                value = fallback[name][block]
            if value is None:
                continue
            if tuple(value.shape) != tuple(local.shape):  # an internal invariant: the layouts disagree
                raise AssertionError(
                    f"{name}: block {block} has shape {tuple(value.shape)}, shard {tuple(local.shape)}"
                )
            local.copy_(value.to(local.dtype))
