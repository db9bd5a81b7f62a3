"""Allgather-swap: switch the actor between its training layout and its inference layout.

    training layout (dp x tp_train, FSDP2 shards)                inference layout (replicas x tp_infer)
    enter():  offload optimizer state, drop grads
              for each bucket:  buffer = empty(sum of THIS rank's inference shards in the bucket)
                  for each param: gather dp shards (FSDP) -> tp_train slices (all-gather over tp_train)
                                  -> copy only this rank's tp_infer slice into the buffer; free the transient
                                  -> the inference model's parameter becomes a view of the buffer
              offload training params (and the reference model's)
    exit():   inference parameters -> meta; buffers freed; params and optimizer state back, bit for bit

Buffers are sized from the inference layout, so no rank ever holds bytes it will not serve with. No full
parameter is ever built: a gathered chunk is at most a quarter of `reshard.bucket_mb` (outputs plus gloo's
flat staging copies of two stages stay within one bucket), so the switch's extra peak over the steady state
stays within one bucket plus the inference shard. `reshard.bucket_mb` must hold the largest tensor (checked;
the default is exactly that, rounded up to MiB).

Two baselines for `dockrl bench reshard`: `enter(baseline="streaming")` is what verl-style weight sync does:
gather one whole tensor at a time on every rank, stream it into a flat staging bucket of `reshard.bucket_mb`,
and hand the full bucket over to the inference model, which keeps its shard; `enter(naive=True)` gathers the
whole state dict on every rank first, then cuts the inference shard out of it.

LoRA (an engine built with `lora`): the inference model is the plain decoder, and each adapted weight is
merged as it lands in its bucket: W + s B A for this rank's inference slice only, in row chunks of at most a
quarter bucket (fp32), with the whole adapters gathered once per switch (r x (in + out) per layer, small). The
base weight arrives in its own dtype, so the merge rounds once, to the bucket's dtype.

Lifecycle: built once in `ActorWorker.setup`; enter / exit alternate (rollout between them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dockrl.engines.reshard.offload import HostSwap
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.decoder import Transformer
from dockrl.models.tp_plan import local_args
from dockrl.parallel.layout import Layout
from dockrl.parallel.tensor_parallel import parallelize

T = TypeVar("T")


@dataclass(frozen=True)
class OffloadFlags:
    """What leaves the device while the inference layout is active."""

    optimizer: bool = True
    grads: bool = True
    params: bool = True


@dataclass
class _ParamSpec:
    name: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]  # this rank's inference shard
    offset: int  # elements into the bucket buffer

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class _Bucket:
    specs: list[_ParamSpec] = field(default_factory=list)
    numel: int = 0


class RolloutSwitch:
    """Owns the inference model (tp_infer-parallel) of one actor rank and the switches into and out of it."""

    def __init__(
        self,
        engine: TrainEngine,
        *,
        rank: int,
        world: int,
        tp_infer: int,
        infer_group: dist.ProcessGroup | None,
        bucket_bytes: int | None,
        dtype: torch.dtype,
        offload: OffloadFlags = OffloadFlags(),
        host_copy: bool | None = None,
        extra_offload: tuple[nn.Module, ...] = (),
    ) -> None:
        self.engine, self.rank, self.dtype, self.flags = engine, rank, dtype, offload
        self.device = engine.device
        self.infer_layout = Layout(world, tp_infer)
        self.extra_offload = extra_offload
        with torch.device("meta"):
            full_shapes = {n: tuple(p.shape) for n, p in Transformer(engine.args).named_parameters()}
            model = Transformer(engine.args)
            if tp_infer > 1:
                assert infer_group is not None, "an inference tp group comes with tp_infer > 1"
                parallelize(model, rank % tp_infer, tp_infer, infer_group, gather_logits=True)
        # KV caches are sized from model.args: a tensor-parallel inference model describes its local heads.
        model.args = local_args(engine.args, tp_infer)
        self.model = model.requires_grad_(False).eval()
        self.buckets = self._plan_buckets(full_shapes, bucket_bytes)
        self.buffers: list[torch.Tensor] = []
        self.optimizer_swap = HostSwap("optimizer", host_copy=host_copy)
        self.param_swap = HostSwap("params", host_copy=host_copy)
        self.active = False

    def _plan_buckets(
        self, full_shapes: dict[str, tuple[int, ...]], bucket_bytes: int | None
    ) -> list[_Bucket]:
        """Consecutive parameters whose inference shards fit `bucket_bytes` (None: the largest tensor)."""
        shards = []
        for name, param in self.model.named_parameters():
            shape = self.infer_layout.shard_shape(name, full_shapes[name], self.rank)
            assert shape == tuple(param.shape), (name, shape, tuple(param.shape))
            shards.append((name, full_shapes[name], shape))
        buckets, self.bucket_bytes = plan_buckets(shards, bucket_bytes, self.dtype)
        return buckets

    @torch.no_grad()
    def broadcast_weights(self, group: dist.ProcessGroup | None) -> int:
        """Separate rollout placement: gather the full weights bucket by bucket (a collective over the actor's
        ranks, chunked as in `enter`) and broadcast each bucket from this group's rank 0 (actor rank 0) to the
        rollout replicas in `group` (None on the other actor ranks). Never more than one bucket at a time;
        returns the bytes sent. Needs rollout.tp=1 (full tensors in every bucket)."""
        assert self.infer_layout.tp == 1, "broadcast_weights sends full tensors (rollout.tp=1)"
        sent = 0
        for buffer, views in self._gathered_buckets(dict(self.engine.model.named_parameters())):
            if group is not None:
                broadcast_bucket(group, buffer)
                sent += buffer.numel() * buffer.element_size()
            del buffer, views  # before the next bucket is gathered: one bucket alive at a time
        return sent

    @torch.no_grad()
    def broadcast_adapters(self, group: dist.ProcessGroup | None) -> int:
        """Separate rollout placement under LoRA: send the adapters only (fp32, in `models.lora.adapter_layout`
        order, bucketed like a replica's `ReplicaWeights`), never the frozen base the replicas hold already.
        A collective over the actor's ranks (each factor gathered whole: small); this group's rank 0 (actor
        rank 0) broadcasts to the replicas in `group` (None on the other actor ranks). Returns the bytes sent."""
        assert self.engine.lora is not None, "broadcast_adapters needs a LoRA engine"
        adapters = self._gather_adapters(dict(self.engine.model.named_parameters()))
        if group is None:  # not rank 0: its part was the gathers
            return 0
        sent = 0
        for bucket in adapter_buckets(self.engine.args, self.engine.lora, self.bucket_bytes):
            buffer = torch.empty(bucket.numel, dtype=torch.float32, device=self.device)
            for spec in bucket.specs:
                buffer[spec.offset : spec.offset + spec.numel].copy_(adapters[spec.name].reshape(-1))
            broadcast_bucket(group, buffer)
            sent += buffer.numel() * buffer.element_size()
        return sent

    @property
    def inference_shard_bytes(self) -> int:
        """Bytes of this rank's inference weights (all buffers together)."""
        return sum(b.numel for b in self.buckets) * torch.empty((), dtype=self.dtype).element_size()

    # ---- enter / exit ---------------------------------------------------------------------------

    @torch.no_grad()
    def enter(self, *, naive: bool = False, baseline: str | None = None) -> dict[str, float]:
        """Training -> inference layout (a collective: every actor rank calls it). `naive` and
        baseline="streaming" run the benchmark's baselines (module docstring) instead of the bucketed gather."""
        assert not self.active, "enter() twice without exit()"
        start = time.perf_counter()
        offloaded = self._prepare_enter()
        train_params = dict(self.engine.model.named_parameters())
        if baseline == "streaming":
            assert self.engine.lora is None, "the streaming baseline does not merge LoRA adapters"
            self._enter_streaming(train_params)
            return self._finish_enter(train_params, offloaded, start)
        full = {n: self._full(n, p) for n, p in train_params.items()} if naive else None
        adapters = self._gather_adapters(train_params)
        for bucket in self.buckets:
            buffer = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            if full is None:
                self._gather_bucket(bucket, train_params, buffer)
            for spec in bucket.specs:
                view = buffer[spec.offset : spec.offset + spec.numel].view(spec.shape)
                if full is not None:
                    self._cut_into(spec, full[spec.name], view)
                self._merge_adapter(spec, view, adapters)
                set_param(self.model, spec.name, view)
            self.buffers.append(buffer)
        del full
        return self._finish_enter(train_params, offloaded, start)

    @torch.no_grad()
    def enter_into(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], T]) -> T:
        """Training -> an external inference engine (rollout.backend=vllm; a collective: every actor rank calls
        it): as `enter`, but each bucket's (name, tensor) pairs go to `load` (which consumes them one at a time,
        as vLLM's reload does) and the bucket is freed once they are taken; no inference model is kept here.
        Needs full tensors in the buckets (tp_infer=1: the engine cuts its own tensor-parallel slices).
        Returns what `load` returns."""
        assert not self.active, "enter_into() twice without exit()"
        assert self.infer_layout.tp == 1, "enter_into streams full tensors (build the switch with tp_infer=1)"
        start = time.perf_counter()
        offloaded = self._prepare_enter()
        train_params = dict(self.engine.model.named_parameters())
        result = load(self._stream(train_params))
        self._finish_enter(train_params, offloaded, start)
        return result

    def _stream(self, train_params: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, full and LoRA-merged, bucket by bucket: a bucket is gathered when its first tensor is
        asked for and dropped when the next bucket's is."""
        for _, views in self._gathered_buckets(train_params):
            yield from views

    def _gathered_buckets(
        self, train_params: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]:
        """Each bucket's buffer gathered (a collective over the actor's ranks) with its LoRA adapters merged, and
        its (name, view) pairs; one bucket alive at a time, freed when the caller asks for the next."""
        adapters = self._gather_adapters(train_params)
        for bucket in self.buckets:
            buffer = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            self._gather_bucket(bucket, train_params, buffer)
            views = []
            for spec in bucket.specs:
                view = buffer[spec.offset : spec.offset + spec.numel].view(spec.shape)
                self._merge_adapter(spec, view, adapters)
                views.append((spec.name, view))
            yield buffer, views
            del views, buffer

    def _prepare_enter(self) -> int:
        """Drop grads, offload optimizer state, reshard FSDP modules; returns the bytes offloaded."""
        engine = self.engine
        offloaded = 0
        if engine.optimizer is not None and self.flags.grads:
            engine.optimizer.zero_grad(set_to_none=True)
        if engine.optimizer is not None and self.flags.optimizer:
            offloaded += self.optimizer_swap.offload(_optimizer_tensors(engine.optimizer))
        for module in engine.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return offloaded

    def _finish_enter(self, train_params: dict, offloaded: int, start: float) -> dict[str, float]:
        if self.flags.params:
            params = [p for p in train_params.values()]
            params += [p for module in self.extra_offload for p in module.parameters()]
            offloaded += self.param_swap.offload(params)
        self.active = True
        return {"seconds": time.perf_counter() - start, "offloaded_bytes": float(offloaded)}

    def _enter_streaming(self, train_params: Mapping[str, torch.Tensor]) -> None:
        """The streaming baseline: whole tensors, one at a time, through a flat staging bucket of bucket_bytes
        (the size the bucketed switch uses); each full bucket is handed over (the inference shards cut out)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        stage = torch.empty(self.bucket_bytes // size, dtype=self.dtype, device=self.device)
        staged: list[tuple[_ParamSpec, int, torch.Tensor]] = []
        fill = 0

        def hand_over() -> None:
            for spec, offset, view in staged:
                numel = int(torch.Size(spec.full_shape).numel())
                self._cut_into(spec, stage[offset : offset + numel].view(spec.full_shape), view)
            staged.clear()

        for bucket in self.buckets:
            buffer = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            for spec in bucket.specs:
                view = buffer[spec.offset : spec.offset + spec.numel].view(spec.shape)
                full = self._full(spec.name, train_params[spec.name])
                if fill + full.numel() > stage.numel():
                    hand_over()
                    fill = 0
                stage[fill : fill + full.numel()].copy_(full.reshape(-1))
                staged.append((spec, fill, view))
                fill += full.numel()
                del full
                set_param(self.model, spec.name, view)
            self.buffers.append(buffer)
        hand_over()

    @torch.no_grad()
    def exit(self) -> dict[str, float]:
        """Inference -> training layout: free the buffers, bring training state back (local, no collective)."""
        assert self.active, "exit() without enter()"
        start = time.perf_counter()
        for bucket in self.buckets:
            for spec in bucket.specs:
                set_param(self.model, spec.name, torch.empty(spec.shape, dtype=self.dtype, device="meta"))
        self.buffers = []
        if self.param_swap.offloaded:
            self.param_swap.onload()
        if self.optimizer_swap.offloaded:
            self.optimizer_swap.onload()
        self.active = False
        return {"seconds": time.perf_counter() - start}

    # ---- gathers --------------------------------------------------------------------------------

    def _gather_adapters(self, train_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every LoRA factor, whole (a collective: FSDP over dp, then tp); {} without LoRA."""
        if self.engine.lora is None:
            return {}
        return {
            name: self._full(name, param).detach()
            for name, param in train_params.items()
            if name.endswith((".lora_A", ".lora_B"))
        }

    def _merge_adapter(
        self, spec: _ParamSpec, out: torch.Tensor, adapters: Mapping[str, torch.Tensor]
    ) -> None:
        """out (this rank's inference slice of spec.name) += s B A over the same slice, in row chunks."""
        module = spec.name.removesuffix(".weight")
        a, b = adapters.get(f"{module}.lora_A"), adapters.get(f"{module}.lora_B")
        if a is None or b is None or not spec.name.endswith(".weight"):
            return
        scaling = self.engine.lora.scaling if self.engine.lora is not None else 1.0
        dim, start, end = self.infer_layout.shard_slice(spec.name, spec.full_shape, self.rank)
        if dim == 0:
            b = b[start:end]  # [O_slice, r]
        elif dim == 1:
            a = a[:, start:end]  # [r, I_slice]
        a = a.float()
        rows = max(1, (self.bucket_bytes // 4) // max(1, 4 * out.shape[1]))
        for r in range(0, out.shape[0], rows):
            chunk = out[r : r + rows]
            chunk.copy_((chunk.float() + scaling * (b[r : r + rows].float() @ a)).to(out.dtype))

    def _full(self, name: str, param: torch.Tensor) -> torch.Tensor:
        from dockrl.parallel.layout import full_tensor

        return full_tensor(param, self.engine.placement(name))

    def _cut_into(self, spec: _ParamSpec, full: torch.Tensor, out: torch.Tensor) -> None:
        dim, start, end = self.infer_layout.shard_slice(spec.name, spec.full_shape, self.rank)
        out.copy_(full if dim is None else full.narrow(dim, start, end - start))

    def _gather_bucket(
        self, bucket: _Bucket, train_params: Mapping[str, torch.Tensor], buffer: torch.Tensor
    ) -> None:
        """Every spec of `bucket` into its view of `buffer`. A tensor sharded over dp only (FSDP2's dim-0 shards, no
        tp or ep split) that each inference rank holds whole joins its neighbours in one all-gather, as many as fit
        a quarter bucket (the bound `_gather_into` keeps): one collective for a bucket of small tensors instead of
        one per tensor. The others, and any too large for that, go through `_gather_into`. A gather only moves
        bytes, so the buffer holds the same values either way."""
        batch: list[tuple[_ParamSpec, torch.Tensor, int]] = []
        batch_bytes = 0
        group: dist.ProcessGroup | None = None
        for spec in bucket.specs:
            view = buffer[spec.offset : spec.offset + spec.numel].view(spec.shape)
            param = train_params[spec.name]
            whole = self._dp_only(spec, param)
            if whole is None:
                self._gather_into(spec, param, view)
                continue
            local, dp_group, dp, shard_rows = whole
            row_numel = int(torch.Size(spec.full_shape[1:]).numel())
            nbytes = dp * shard_rows * row_numel * local.element_size()
            if nbytes > self.bucket_bytes // 4:
                self._gather_into(spec, param, view)
                continue
            same = not batch or (dp_group is group and local.dtype == batch[0][1].dtype)
            if not same or batch_bytes + nbytes > self.bucket_bytes // 4:
                self._gather_batch(batch, buffer, group)
                batch, batch_bytes = [], 0
            batch.append((spec, local, shard_rows))
            batch_bytes += nbytes
            group = dp_group
        if batch:
            self._gather_batch(batch, buffer, group)

    def _dp_only(
        self, spec: _ParamSpec, param: torch.Tensor
    ) -> tuple[torch.Tensor, dist.ProcessGroup, int, int] | None:
        """(local shard, dp group, dp, rows per shard) of a tensor sharded over dp only and held whole by every
        inference rank; None for any other layout."""
        if not isinstance(param, DTensor) or self.engine.placement(spec.name).size > 1:
            return None
        if self.infer_layout.shard_slice(spec.name, spec.full_shape, self.rank)[0] is not None:
            return None
        group = param.device_mesh.get_group()
        dp = dist.get_world_size(group)
        return param.to_local(), group, dp, -(-spec.full_shape[0] // dp)

    def _gather_batch(
        self,
        batch: list[tuple[_ParamSpec, torch.Tensor, int]],
        buffer: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> None:
        """One all-gather of the batch's dp shards (each padded to its rows per shard), then each tensor's rows in
        rank order (FSDP2 splits dim 0 like torch.chunk) into its view of `buffer`."""
        dp = dist.get_world_size(group)
        pieces = []
        for spec, local, shard_rows in batch:
            if local.shape[0] < shard_rows:  # a short (or empty) last shard
                local = torch.cat(
                    [local, local.new_zeros((shard_rows - local.shape[0], *spec.full_shape[1:]))]
                )
            pieces.append(local.reshape(-1))
        flat = torch.cat(pieces)
        out = torch.empty(dp * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_single(out, flat, group=group)
        by_rank = out.view(dp, flat.numel())
        offset = 0
        for spec, _, shard_rows in batch:
            numel = shard_rows * int(torch.Size(spec.full_shape[1:]).numel())
            rows = by_rank[:, offset : offset + numel].reshape(dp * shard_rows, *spec.full_shape[1:])
            buffer[spec.offset : spec.offset + spec.numel].view(spec.shape).copy_(rows[: spec.full_shape[0]])
            offset += numel

    def _gather_into(self, spec: _ParamSpec, param: torch.Tensor, out: torch.Tensor) -> None:
        """Copy this rank's inference slice of `param` into `out`, gathering training shards in chunks.

        The full tensor is never built: rows of the FSDP shard are gathered a chunk at a time, first over dp
        (FSDP2's dim-0 shards) then over tp_train (the tensor-parallel slices), and only the part of each
        gathered chunk that lies inside this rank's inference slice is copied into `out`. A chunk gathers at
        most `bucket_bytes / 4` bytes, so the transient of the gathers (outputs plus gloo's flat staging
        copies) stays within one bucket.
        """
        if isinstance(param, DTensor):
            local, dp_group = param.to_local(), param.device_mesh.get_group()
            dp = dist.get_world_size(dp_group)
        else:
            local, dp_group, dp = param.detach(), None, 1
        placement = self.engine.placement(spec.name)  # the tp split, or the ep split of experts
        train_dim = placement.dim if placement.size > 1 else None
        tp = placement.size if train_dim is not None else 1
        dim, start, end = self.infer_layout.shard_slice(spec.name, spec.full_shape, self.rank)
        if dp == 1 and tp == 1:
            out.copy_(local if dim is None else local.narrow(dim, start, end - start))
            return
        slice_shape = list(spec.full_shape)  # this rank's training (tp) slice, before FSDP sharding
        if train_dim is not None:
            slice_shape[train_dim] //= tp
        rows, row_shape = slice_shape[0], tuple(slice_shape[1:])
        shard_rows = -(-rows // dp)  # FSDP2 splits dim 0 like torch.chunk; the last shards may be short
        row_bytes = int(torch.Size(row_shape).numel()) * local.element_size()
        step = max(1, min(shard_rows, (self.bucket_bytes // 4) // max(1, row_bytes * dp * tp)))
        for r in range(0, shard_rows, step):
            n = min(step, shard_rows - r)
            piece = local[r : r + n]
            if piece.shape[0] < n:  # a short (or empty) last shard: pad to the common chunk shape
                piece = torch.cat([piece, piece.new_zeros((n - piece.shape[0], *row_shape))])
            block = piece.contiguous()
            if dp > 1:
                block = _all_gather(block, dp_group, dp)  # [dp * n, ...]: rank j's rows j*R + r ...
            if tp > 1:
                block = _all_gather(block, placement.group, tp)  # [tp * dp * n, ...]
            for t in range(tp):
                for j in range(dp):
                    lo = j * shard_rows + r  # first row of this piece in the tp slice
                    count = min(n, rows - lo)
                    if count <= 0:
                        continue
                    part = block[(t * dp + j) * n :][:count]
                    row0 = lo + (t * rows if train_dim == 0 else 0)  # in the full tensor
                    col0 = t * slice_shape[1] if train_dim == 1 else 0
                    _copy_overlap(part, row0, col0, out, dim, start, end)
            del block, piece


def plan_buckets(
    shards: list[tuple[str, tuple[int, ...], tuple[int, ...]]], bucket_bytes: int | None, dtype: torch.dtype
) -> tuple[list[_Bucket], int]:
    """Buckets of consecutive (name, full shape, shard shape) parameters whose shards fit `bucket_bytes`, and
    the bucket size (None: the largest tensor in fp32, rounded up to MiB). The trainer and a separate rollout
    replica plan from the same model and settings, so their buckets line up."""
    size = torch.empty((), dtype=dtype).element_size()
    name, full_shape, _ = max(shards, key=lambda s: torch.Size(s[1]).numel())
    # A tensor never spans two buckets, and the chunked gathers of one tensor stay within a bucket: the
    # bucket must hold the largest tensor (fp32, the training dtype).
    workspace = 4 * torch.Size(full_shape).numel()
    if bucket_bytes is None:
        bucket_bytes = -(-workspace // 2**20) * 2**20
    if bucket_bytes < workspace:
        raise ValueError(
            f"reshard.bucket_mb={bucket_bytes / 2**20:.1f} is smaller than the largest tensor {name} "
            f"({workspace / 2**20:.1f} MiB in fp32); use reshard.bucket_mb >= {-(-workspace // 2**20)} or None"
        )
    buckets = [_Bucket()]
    for name, full, shape in shards:
        numel = int(torch.Size(shape).numel())
        if buckets[-1].specs and (buckets[-1].numel + numel) * size > bucket_bytes:
            buckets.append(_Bucket())
        buckets[-1].specs.append(_ParamSpec(name, full, shape, buckets[-1].numel))
        buckets[-1].numel += numel
    return buckets, bucket_bytes


def full_model_buckets(
    model: nn.Module, bucket_bytes: int | None, dtype: torch.dtype
) -> tuple[list[_Bucket], int]:
    """The buckets `broadcast_weights` sends, planned on the receiving side from an unsharded model, and the
    resolved bucket size (what the trainer's switch resolved too)."""
    shards = [(n, tuple(p.shape), tuple(p.shape)) for n, p in model.named_parameters()]
    return plan_buckets(shards, bucket_bytes, dtype)


def adapter_buckets(args, spec, bucket_bytes: int) -> list[_Bucket]:
    """The buckets of adapter-only weight sync (models.lora.adapter_layout order, fp32) under the resolved
    bucket size `bucket_bytes`: the trainer (`broadcast_adapters`) and a replica (ReplicaWeights) plan alike."""
    from dockrl.models.lora import adapter_layout

    return plan_buckets(adapter_layout(args, spec), bucket_bytes, torch.float32)[0]


def broadcast_bucket(group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    """Broadcast `buffer` from rank 0 of `group` (a standalone gloo group: see parallel.dist.side_group)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(out, tensor, group=group)
    return out


def _copy_overlap(
    part: torch.Tensor, row0: int, col0: int, out: torch.Tensor, dim: int | None, start: int, end: int
) -> None:
    """Copy the overlap of `part` (full-tensor rows row0.., columns col0..) with out = full[dim: start:end]."""
    src, dst = part, out
    for d, first in list(enumerate((row0, col0)))[: part.dim()]:
        lo, hi = first, first + part.shape[d]
        if dim == d:
            lo, hi = max(lo, start), min(hi, end)
        if lo >= hi:
            return
        src = src.narrow(d, lo - first, hi - lo)
        dst = dst.narrow(d, lo - (start if dim == d else 0), hi - lo)
    dst.copy_(src)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def offload_flags(reshard, device_type: str) -> OffloadFlags:
    """Resolve `reshard.offload_*` (None = on with CUDA) into OffloadFlags."""
    auto = device_type == "cuda"

    def pick(value: bool | None) -> bool:
        return auto if value is None else value

    return OffloadFlags(
        optimizer=pick(reshard.offload_optimizer),
        grads=pick(reshard.offload_grads),
        params=pick(reshard.offload_params),
    )
