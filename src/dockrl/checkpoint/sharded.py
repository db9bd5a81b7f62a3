"""A TrainEngine's training state through torch.distributed.checkpoint, and its Hugging Face export.

`save_engine` / `load_engine` (collectives over the engine's ranks, the default process group):

    model/<name>                  the whole parameter, as a DTensor: each rank writes its block
    optim/<name>/<state key>      AdamW state: exp_avg, exp_avg_sq as DTensors like their parameter; the step
    optim_groups, scheduler       python objects: param-group settings, LambdaLR state

Elastic: a rank's block of a parameter is tensor-parallel slice tp_rank of the split dim (dockrl.models.tp_plan),
then FSDP2's rows dp_rank of that slice (parallel/sharded_load.checkpoint_block). On a ("tp", "dp") view of the
engine's ranks that is the DTensor placement [Shard(split dim) or Replicate(), Shard(0)] of the whole tensor,
so DCP records every block at its offset in the whole tensor, and a load under another (dp, tp) reads each
rank's new block from whichever saved blocks overlap it: a checkpoint resumes under any layout, with the same
values (only the arithmetic of later steps reassociates). Replicated blocks (tp ranks of one dp rank) are
written once. Experts under expert parallelism (actor.ep) are split over ep along dim 0 and FSDP2-sharded over
edp: on an ("ep", "edp") view that is [Shard(0), Shard(0)], so an MoE checkpoint resumes under any (dp, ep) as
well. Checkpoints written before this layout (keys `<name>@tp<rank>` under tp > 1) still load, in
the layout that wrote them only; tp=1 ones never carried the rank and load under any layout.

LoRA: a checkpoint holds the adapters and their optimizer state only, with `lora_base`, a pointer to the frozen
base (its resolved path and `models.hf.weights_fingerprint`). Resume reads the base from model.path again and
refuses a base whose fingerprint differs; a checkpoint of one kind (LoRA or full) never loads into the other.

An optimizer that has not stepped yet (PPO's actor during critic warm-up) has no state and saves none:
initialising it for the checkpoint would change the run.

`export_hf` writes the weights as a Hugging Face directory in the checkpoint's source dtype, gathering one
tensor at a time onto global rank 0 (over dp, then over tp) and streaming it into its safetensors file
(models.hf.HFWriter), so no rank ever holds more than one whole tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dockrl.checkpoint.directory import fsync_tree
from dockrl.models.hf import LM_HEAD_KEY, HFWriter
from dockrl.parallel.expert_parallel import is_expert_param

_GROUP_SKIP = ("params",)
LORA_BASE = "lora_base"
GATHER_BLOCK_BYTES = 8 * 2**20  # per rank and gather step of a Hugging Face export


_ADAPTER_SUFFIXES = (".lora_A", ".lora_B")  # LoRA factors (dockrl.models.lora): merged into the HF export


def _named_params(engine) -> list[tuple[str, torch.nn.Parameter]]:
    return list(engine.model.named_parameters())


def _saved_params(engine) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a checkpoint holds: all of them, or under LoRA the adapters only."""
    params = _named_params(engine)
    return params if engine.lora is None else [(n, p) for n, p in params if n.endswith(_ADAPTER_SUFFIXES)]


def lora_base(engine) -> dict[str, str]:
    """What a LoRA checkpoint records of its frozen base: the resolved path and the weights' fingerprint."""
    return {"model_path": str(Path(engine.model_path).resolve()), "fingerprint": engine.base_fingerprint}


class _LayoutMeshes:
    """The engine's ranks as a ("tp", "dp") mesh (tp outer: a parameter is split over tp first, and FSDP2
    shards each slice's rows over dp), and under expert parallelism as an ("ep", "edp") mesh for the experts;
    no process groups are made for them."""

    def __init__(self, engine) -> None:
        # (dp x cp, tp): FSDP2 shards over the dp x cp ranks (cp = 1 but under context parallelism), tp contiguous
        ranks = engine.mesh.mesh.reshape(engine.shard_size, engine.tp_size)
        device = engine.mesh.device_type
        self.dense = DeviceMesh(
            device, ranks.T.contiguous(), mesh_dim_names=("tp", "dp"), _init_backend=False
        )
        self.experts = None
        if engine.ep_size > 1:  # tp is 1: dp_rank = edp_rank x ep + ep_rank
            grid = engine.mesh.mesh.reshape(engine.dp_size // engine.ep_size, engine.ep_size)
            self.experts = DeviceMesh(
                device, grid.T.contiguous(), mesh_dim_names=("ep", "edp"), _init_backend=False
            )


def _layout_mesh(engine) -> _LayoutMeshes | None:
    """The engine's layout meshes (`_LayoutMeshes`); None without a mesh."""
    return None if engine.mesh is None else _LayoutMeshes(engine)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block of a parameter or optimizer state, sharing its storage (no autograd)."""
    return tensor.to_local().data if isinstance(tensor, DTensor) else tensor.data


def _whole(engine, meshes: _LayoutMeshes | None, name: str, local: torch.Tensor) -> torch.Tensor:
    """`local`, this rank's block of parameter `name` (or of a state shaped like it), as a DTensor of the whole
    tensor (sharing the block's storage, so a load fills the engine in place); `local` itself without a mesh."""
    if meshes is None:
        return local
    placement = engine.placement(name)
    dim = placement.dim if placement.size > 1 else None
    mesh = meshes.dense
    if meshes.experts is not None and is_expert_param(name):
        mesh = meshes.experts
    shape = torch.Size(engine.global_shapes[name])
    return DTensor.from_local(
        local,
        mesh,
        (Replicate() if dim is None else Shard(dim), Shard(0)),
        run_check=False,
        shape=shape,
        stride=_contiguous_strides(shape),
    )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def engine_state(engine) -> dict[str, Any]:
    """The flat dict DCP saves for `engine` (DTensors of whole tensors over the live parameters and optimizer
    state: nothing is copied)."""
    mesh = _layout_mesh(engine)
    state: dict[str, Any] = {}
    for name, param in _saved_params(engine):
        state[f"model/{name}"] = _whole(engine, mesh, name, _local(param))
    if engine.lora is not None:
        state[LORA_BASE] = (lora_base(engine),)
    optimizer = engine.optimizer
    if optimizer is not None:
        for name, param in _saved_params(engine):
            for key, value in optimizer.state.get(param, {}).items():
                per_element = isinstance(value, DTensor) or value.shape == param.shape
                state[f"optim/{name}/{key}"] = (
                    _whole(engine, mesh, name, _local(value)) if per_element else value
                )
        # Tuples are leaves to DCP (dicts would be flattened into keys): each is saved as one object.
        state["optim_groups"] = tuple(
            {k: v for k, v in group.items() if k not in _GROUP_SKIP} for group in optimizer.param_groups
        )
        state["scheduler"] = (engine.scheduler.state_dict(),)
    return state


def save_engine(engine, path: str | Path) -> None:
    """Write `engine`'s model, optimizer and LR schedule to directory `path` (all ranks call it)."""
    import torch.distributed.checkpoint as dcp  # here, not at import: it costs every worker ~0.2 s of start

    dcp.save(engine_state(engine), checkpoint_id=str(path))


def load_engine(engine, path: str | Path) -> None:
    """Restore what `save_engine` wrote into `engine`, resharded to `engine`'s (dp, tp) layout when it differs
    from the one that saved it (all ranks call it)."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _check_kind(engine, path, LORA_BASE in saved)
    legacy = any("@tp" in key for key in saved)  # written before elastic checkpoints: same layout only
    mesh = None if legacy else _layout_mesh(engine)
    state: dict[str, Any] = {}
    optim_state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for name, param in _saved_params(engine):
        key = f"{name}@tp{engine.tp_rank}" if legacy and engine.tp_size > 1 else name

        def target(value: torch.Tensor, name: str = name) -> torch.Tensor:
            if legacy:  # the old format saved the FSDP2 DTensors themselves (whole = this tp slice)
                return value if isinstance(value, DTensor) else value.data
            return _whole(engine, mesh, name, _local(value))

        state[f"model/{key}"] = target(param)
        if engine.optimizer is None:
            continue
        prefix = f"optim/{key}/"
        keys = [k.removeprefix(prefix) for k in saved if k.startswith(prefix)]
        if keys:
            optim_state[param] = {
                k: _template(saved[prefix + k], param, engine.global_shapes[name], legacy) for k in keys
            }
            state.update(
                {
                    prefix + k: target(value) if value.shape == param.shape else value
                    for k, value in optim_state[param].items()
                }
            )
    missing = sorted(k for k in state if k not in saved)
    if missing:
        why = "another model"
        if legacy:
            why += ", or before elastic resume (keys carry the tp rank): it loads only in the layout that wrote it"
        raise ValueError(
            f"checkpoint {path} lacks {len(missing)} entries this run needs, e.g. {missing[:3]}: it was written "
            f"by {why}"
        )
    if engine.optimizer is not None:
        state["optim_groups"] = None
        state["scheduler"] = None
    if engine.lora is not None:
        state[LORA_BASE] = None
    dcp.load(state, checkpoint_id=str(path))
    if engine.lora is not None:
        _check_base(engine, path, state[LORA_BASE][0])
    if engine.optimizer is None:
        return
    for param, values in optim_state.items():
        engine.optimizer.state[param] = values
    for group, saved_group in zip(engine.optimizer.param_groups, state["optim_groups"]):
        group.update(saved_group)
    engine.scheduler.load_state_dict(state["scheduler"][0])


def _check_kind(engine, path: str | Path, saved_lora: bool) -> None:
    """A LoRA checkpoint (adapters only) loads into a LoRA engine, a full one into a full engine."""
    if saved_lora == (engine.lora is not None):
        return
    if saved_lora:
        raise ValueError(
            f"checkpoint {path} holds LoRA adapters only (actor.lora), and this run trains every weight: resume "
            "it with the run's actor.lora settings, or start full fine-tuning from its merged export "
            "(dockrl export CHECKPOINT OUT --merge, then model.path=OUT)"
        )
    raise ValueError(
        f"checkpoint {path} holds the whole model of a full fine-tuning run, and this run trains LoRA "
        "adapters: resume it with actor.lora.rank=0, or start LoRA from its weights with model.path=CHECKPOINT"
    )


def _check_base(engine, path: str | Path, saved: dict[str, str]) -> None:
    """The base a LoRA checkpoint was trained on is the one this engine loaded (same weights' fingerprint)."""
    if saved["fingerprint"] == engine.base_fingerprint:
        return
    raise ValueError(
        f"checkpoint {path} holds LoRA adapters trained on the base {saved['model_path']}, but model.path="
        f"{engine.model_path} holds other weights (their fingerprints differ): adapters apply only to the "
        "base they were trained on; point model.path at that base"
    )


def _template(metadata, param: torch.Tensor, whole_shape: tuple[int, ...], legacy: bool) -> torch.Tensor:
    """A tensor to load one optimizer state entry into: shaped (and sharded) like `param` when it is per
    element (Adam's moments: saved with the parameter's whole shape, or, in the legacy format, its tp slice's),
    else a plain tensor of the saved size and dtype (Adam's step counter)."""
    if tuple(metadata.size) == (tuple(param.shape) if legacy else tuple(whole_shape)):
        return torch.zeros_like(param, dtype=metadata.properties.dtype)
    return torch.zeros(tuple(metadata.size), dtype=metadata.properties.dtype)


def export_hf(
    engine, path: str | Path, *, tokenizer_dir: str | None, max_shard_bytes: int = 2 * 2**30
) -> None:
    """Write `engine`'s weights as a Hugging Face directory in `engine.source_dtype` (all ranks call it;
    global rank 0 gathers one tensor at a time and streams it to its file, so it holds one tensor at most).
    A LoRA engine writes its adapted weights merged (W + (alpha/r) B A, in fp32, then cast)."""
    dtype = engine.source_dtype
    params = dict(_named_params(engine))
    names = [
        n
        for n in params
        if not (engine.args.tie_word_embeddings and n == LM_HEAD_KEY) and not n.endswith(_ADAPTER_SUFFIXES)
    ]
    is_writer = dist.get_rank() == 0
    specs = {n: (engine.global_shapes[n], dtype) for n in names}
    writer = HFWriter(path, engine.args, specs, max_shard_bytes) if is_writer else None
    for name in names:
        whole = gather_to_rank0(engine, name, params[name], engine.global_shapes[name], dtype)
        module = name.removesuffix(".weight")
        if f"{module}.lora_A" in params:  # every rank gathers the factors, in the same order
            a, b = _gather_factors(engine, params, module)
            if writer is not None:  # rank 0 holds the whole tensors
                assert whole is not None and a is not None and b is not None
                whole = (whole.float() + engine.lora.scaling * (b @ a)).to(dtype)
        if writer is not None:
            assert whole is not None  # rank 0 gathers every tensor whole
            writer.write(name, whole.to("cpu", dtype))
        del whole
    if writer is not None:
        writer.finish(dtype, tokenizer_dir)
        fsync_tree(Path(path))  # on the node that wrote it (the driver's commit fsyncs again, from its node)
    dist.barrier()


def export_adapter(engine, path: str | Path) -> None:
    """Write a LoRA engine's adapters, whole and fp32, as a PEFT adapter directory whose
    base_model_name_or_path is the resolved base path (all ranks call it; global rank 0 writes)."""
    from dockrl.models.lora import lora_layers, save_peft_tensors

    params = dict(_named_params(engine))
    adapters: dict[str, torch.Tensor] = {}
    for module, _ in lora_layers(engine.model):
        a, b = _gather_factors(engine, params, module)
        if a is not None and b is not None:  # rank 0
            adapters[f"{module}.lora_A"], adapters[f"{module}.lora_B"] = a, b
    if dist.get_rank() == 0:
        fsync_tree(save_peft_tensors(adapters, path, engine.lora, lora_base(engine)["model_path"]))
    dist.barrier()


def _gather_factors(engine, params, module: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """LoRA factors A [r, I] and B [O, r] of `module`, whole and fp32 on global rank 0 (None elsewhere)."""
    a, b = (
        gather_to_rank0(engine, f, params[f], engine.global_shapes[f], torch.float32)
        for f in (f"{module}.lora_A", f"{module}.lora_B")
    )
    return a, b


def gather_to_rank0(
    engine, name: str, param: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """Parameter `name` whole on global rank 0 (None elsewhere), cast to `dtype` before it moves: its FSDP
    rows gathered over dp (edp for experts) onto that group's rank 0, then its tensor-parallel slices over tp
    (experts: ep) onto that group's rank 0."""
    local = param.to_local() if isinstance(param, DTensor) else param.data
    local = local.detach().to(dtype or local.dtype)
    placement = engine.placement(name)
    if placement.fsdp_size > 1:
        rows = _gather_rows(
            local, placement.fsdp_group, placement.fsdp_rank, placement.fsdp_size, placement.slice_rows(shape)
        )
        if rows is None:  # not the FSDP group's rank 0
            return None
        local = rows
    if placement.fsdp_rank != 0:
        return None
    dim = placement.dim if placement.size > 1 else None
    if dim is None:
        return local if placement.rank == 0 else None
    parts = [torch.empty_like(local) for _ in range(placement.size)] if placement.rank == 0 else None
    dist.gather(local.contiguous(), parts, group_dst=0, group=placement.group)
    return torch.cat(parts, dim=dim) if parts is not None else None


def _gather_rows(local: torch.Tensor, group, rank: int, size: int, rows: int) -> torch.Tensor | None:
    """The FSDP2 row shards of `rows` rows joined on group rank 0 (torch.chunk sizes). Gathered in blocks of
    at most GATHER_BLOCK_BYTES per rank, so rank 0 holds the tensor once plus one block from each rank
    (gloo stages a gather's outputs in a flat copy: a whole-shard gather would hold the tensor twice)."""
    chunk = -(-rows // size)
    row_bytes = max(1, local[0].numel() * local.element_size()) if local.shape[0] else 1
    block = max(1, GATHER_BLOCK_BYTES // row_bytes)
    whole = local.new_empty((chunk * size, *local.shape[1:])) if rank == 0 else None
    for start in range(0, chunk, block):
        end = min(chunk, start + block)
        piece = local.new_zeros((end - start, *local.shape[1:]))
        mine = local[start:end]
        piece[: mine.shape[0]] = mine
        parts = [torch.empty_like(piece) for _ in range(size)] if rank == 0 else None
        dist.gather(piece, parts, group_dst=0, group=group)
        if whole is not None and parts is not None:  # rank 0
            for r, part in enumerate(parts):
                whole[r * chunk + start : r * chunk + end] = part
    return whole[:rows] if whole is not None else None
