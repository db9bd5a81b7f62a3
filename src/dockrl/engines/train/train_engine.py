"""The training engine: a model sharded with FSDP2 over dp and tensor-parallel over tp, optimizer and schedule.

Shapes: B rows, T tokens, V vocab (Vl = V / tp on one rank).

Layout: `mesh` is a 1-D ("dp",) mesh or a 2-D ("dp", "tp") mesh (possibly a sub-mesh of a bigger one).
Tensor parallelism (`dockrl.parallel.tensor_parallel`) splits the model first; FSDP2 then shards each rank's local
tensors over the dp group. MoE with `ep` > 1 (expert parallelism, `dockrl.parallel.expert_parallel`): the dp
ranks form an (edp, ep) grid; each keeps E/ep experts per MoE layer, which FSDP2 shards over edp
(`placement(name)` says where any parameter's block lies). Log-probs come from the hidden states and this rank's vocab slice of the LM head
(`token_stats`), never from full logits.

Lifecycle: built once per worker: the model is built on the meta device, split and sharded there, and each
rank reads only its own blocks of the Hugging Face checkpoint into fp32 shards on its device
(`dockrl.parallel.sharded_load`: no rank ever holds the whole model); then `logprobs` (no grad) and `train_step` (one optimizer step over a list of micro-batches)
as often as the recipe asks. Gradient sync: FSDP2 averages gradients over dp ranks, so a loss that must be a
global mean is scaled by the caller (see `ActorWorker.update`) to sum to the right value.
Without a mesh (`dockrl sft`, tests) the same code runs on one process with autocast for bf16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dockrl.algos.head_logprobs import head_support_stats, head_token_stats, head_top_k
from dockrl.config.schema import FSDP_UNIT_PARAMS, OptimConfig
from dockrl.engines.train import context_passes
from dockrl.engines.train.batch import (
    MicroBatch,
    make_micro_batch,
    micro_batch_rows,
    packed_response_positions,
    response_positions,
)
from dockrl.models.decoder import DecoderModel, Transformer
from dockrl.models.hf import CAUSAL_LM, CheckpointReader, ModelKind, read_config, weights_fingerprint
from dockrl.models.lora import LoraSpec, adapters_disabled, apply_lora, fresh_adapters
from dockrl.models.moe import (
    MoEBlock,
    Routing,
    RoutingStats,
    load_balancing_loss,
    router_logits,
    routing,
)
from dockrl.models.native.head import head_kernels
from dockrl.models.precision import dtype_of
from dockrl.models.tp_plan import shard_dim
from dockrl.models.vision import VisionInputs
from dockrl.parallel.expert_parallel import is_expert_param
from dockrl.parallel.fsdp_units import fsdp_units
from dockrl.parallel.layout import Placement, full_tensor

if TYPE_CHECKING:
    from dockrl.parallel.context import ContextShard
from dockrl.parallel.sharded_load import load_sharded

# A loss over what `forward(mb)` returned (the actor: token_stats' log-probs and entropies; the critic: values).
LossFn = Callable[[Any, MicroBatch], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine:
    """A (possibly sharded) causal LM with AdamW; `trainable=False` builds a frozen reference model."""

    def __init__(
        self,
        model_path: str,
        *,
        device: torch.device | str,
        precision: str,
        mesh: DeviceMesh | None = None,
        optim: OptimConfig | None = None,
        total_optimizer_steps: int = 1,
        trainable: bool = True,
        kind: ModelKind = CAUSAL_LM,
        load_weights: bool = True,
        lora: LoraSpec | None = None,
        lora_init: Mapping[str, torch.Tensor] | None = None,
        keep_starting_adapters: bool = False,
        seed: int = 0,
        ep: int = 1,
        packing: bool = False,
        freeze_vision: bool = True,
        fsdp_unit_params: int = FSDP_UNIT_PARAMS,
    ):
        self.device = torch.device(device)
        # The fused LM head's softmax work in C on a CPU (models/native/head.py; None: torch's ops, as on an
        # accelerator or where the native kernels do not build or DOCKRL_NATIVE=off)
        self.head_kernels = head_kernels() if self.device.type == "cpu" else None
        # Padding-free micro-batches (actor.packing, critic.packing; engines/train/batch.py `Packing`): the
        # micro-batches this engine builds for its passes (logprobs, and its callers' updates) are packed
        self.packing = packing  # under context parallelism: False (set by _init_layout, see there)
        self.precision = precision
        self.mesh = mesh
        self.model_path = model_path
        self.args = read_config(model_path)
        self.routing_stats: RoutingStats | None = None  # MoE: set by logprobs(routes=...), see there
        # A vision model (qwen2_5_vl) reads its rows' images through this (models/vision.py); None: text only
        self.vision = VisionInputs.for_model(model_path, self.args) if self.args.vision is not None else None
        # `kind` builds a module with `.args` and `.model.layers` (PPO's critic passes
        # models.value.value_model_kind; its forward returns values [B, T] instead of logits).
        with torch.device("meta"):
            model = kind.build(self.args)
        # LoRA (actor.lora): adapters on the target layers, everything else frozen and held in the compute
        # dtype; the adapters start from `lora_init` (a PEFT adapter, model.lora_path) or fresh ones.
        self.lora = lora
        # A LoRA checkpoint holds the adapters only and pins its base by this (checkpoint.sharded.lora_base).
        self.base_fingerprint = weights_fingerprint(model_path) if lora is not None else None
        fallback = dict(kind.fallback(self.args)) if kind.fallback is not None else {}
        if lora is not None:
            apply_lora(model, lora, seed)
            fallback.update(lora_init if lora_init is not None else fresh_adapters(model, seed))
            _frozen_to_dtype(model, dtype_of(precision))
        # Every parameter's unsplit, unsharded shape (checkpoint blocks and Hugging Face exports use it).
        self.global_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        if not trainable:
            model.requires_grad_(False)
        elif self.args.vision is not None and freeze_vision:  # actor.vision.freeze: the language model trains
            cast(Transformer, model).visual.requires_grad_(False)
        self._init_layout(mesh, ep)
        if self.tp_size > 1:
            from dockrl.parallel.tensor_parallel import parallelize, replicated_names

            assert self.tp_group is not None  # tp_size > 1 comes from the mesh's tp dim, with its group
            # Only a causal LM is split (ModelKind.build is typed as any module).
            parallelize(cast(Transformer, model), self.tp_rank, self.tp_size, self.tp_group)
            self.replicated = replicated_names(model)
            self.vocab_start = self.tp_rank * (self.args.vocab_size // self.tp_size)
        if self.ep_size > 1:
            from dockrl.parallel.expert_parallel import parallelize_experts

            assert self.ep_group is not None
            parallelize_experts(model, self.ep_rank, self.ep_size, self.ep_group)
        if self.context is not None:
            from dockrl.parallel.context import attach

            attach(model, self.context)
        if self.shard_mesh is not None:  # set exactly when `mesh` is
            fully_shard_layers(model, self.shard_mesh, precision, self.edp_mesh, fsdp_unit_params)
        model.to_empty(device=self.device)
        reader = CheckpointReader(model_path)  # headers only
        # Hugging Face exports of this model are written in the dtype its checkpoint came in.
        self.source_dtype = reader.floating_dtype()
        self.model = model
        if load_weights:  # else a resumed run fills the parameters from its checkpoint (load_engine)
            load_sharded(
                model,
                reader,
                self.global_shapes,
                self.placement,
                ignore=lambda name: kind.ignore(name, self.args),
                fallback=fallback or None,
            )
        # algo.kl_reference=adapter: a copy of the adapters as loaded (this rank's shards, adapter-sized), taken
        # before a resume overwrites them with trained ones (load_engine), for `starting_adapters`
        self._starting_adapters: dict[str, torch.Tensor] | None = None
        if keep_starting_adapters:
            assert lora is not None and load_weights, "starting adapters are those the engine loads"
            self._starting_adapters = {
                name: param.detach().clone()
                for name, param in model.named_parameters()
                if name.endswith((".lora_A", ".lora_B"))
            }
        self.optimizer = self.scheduler = None
        if trainable:
            assert optim is not None, "a trainable engine needs optimizer settings"
            self.optim_cfg = optim
            _decoder(model).checkpoint_layers = optim.activation_checkpointing
            self.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],  # LoRA: the adapters only
                lr=optim.lr,
                betas=(optim.adam_beta1, optim.adam_beta2),
                eps=optim.adam_eps,
                weight_decay=optim.weight_decay,
                # one kernel per parameter instead of ~6 elementwise passes (3.8x the for-loop step on a CPU;
                # the same steps up to each step's rounding: tests/unit/test_train_engine_optim.py)
                fused=True,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, _lr_lambda(optim.warmup_steps, total_optimizer_steps, optim.min_lr_ratio)
            )

    def _init_layout(self, mesh: DeviceMesh | None, ep: int) -> None:
        # dp: the data-parallel ranks (different rows); cp: the context-parallel ranks of one dp rank (the same
        # rows, each its zig-zag chunks of every sequence); FSDP2 shards over the dp x cp "shard" ranks, which
        # all compute gradients of the same parameters (the dp ranks themselves when cp = 1).
        self.dp_mesh: DeviceMesh | None = None
        self.dp_group: dist.ProcessGroup | None = None
        self.dp_size, self.dp_rank = 1, 0
        self.cp_size, self.cp_rank = 1, 0
        self.context: ContextShard | None = None
        self.shard_mesh: DeviceMesh | None = None
        self.replica_group: dist.ProcessGroup | None = None
        self.shard_group: dist.ProcessGroup | None = None
        self.shard_size, self.shard_rank = 1, 0
        self.tp_group: dist.ProcessGroup | None = None
        self.tp_size, self.tp_rank = 1, 0
        self.vocab_start = 0  # the first id of this rank's vocab slice (set under tp)
        self.replicated = set[str]()  # tp-replicated parameter names (filled under tp)
        self.ep_size, self.ep_rank = 1, 0
        self.ep_group: dist.ProcessGroup | None = None
        self.edp_mesh: DeviceMesh | None = None  # expert parallelism: the ranks holding the same experts
        if mesh is None:
            assert ep == 1, "expert parallelism needs a data-parallel mesh"
            return
        names = mesh.mesh_dim_names
        assert names is not None, "dockrl's meshes name their dims (dp, tp)"
        dp_mesh = mesh if len(names) == 1 else mesh["dp"]
        self.dp_mesh = dp_mesh
        self.dp_group = dp_mesh.get_group()
        self.dp_size = dp_mesh.size()
        self.dp_rank = dp_mesh.get_local_rank()
        if "tp" in names:
            self.tp_group = mesh.get_group("tp")
            self.tp_size = mesh["tp"].size()
            self.tp_rank = mesh["tp"].get_local_rank()
        self.shard_mesh = dp_mesh
        if "cp" in names and mesh["cp"].size() > 1:
            from dockrl.parallel.context import ContextShard

            assert ep == 1, "context parallelism with expert parallelism is not built (config refuses it)"
            self.context = ContextShard.of_group(mesh.get_group("cp"))
            self.cp_size, self.cp_rank = self.context.size, self.context.rank
            self.shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")
            # a split sequence is a padded row's zig-zag chunks: packed micro-batches are not built under cp
            # (config warns that actor.packing / critic.packing then have no effect)
            self.packing = False
        self.shard_group = self.shard_mesh.get_group()
        # the ranks of one dp rank (contiguous: cp x tp), which read the same rows
        self.replica_group = self.tp_group
        if self.context is not None:
            self.replica_group = self.context.group
            if self.tp_size > 1:
                self.replica_group = mesh["cp", "tp"]._flatten("cp_tp").get_group()
        self.shard_size, self.shard_rank = self.shard_mesh.size(), self.shard_mesh.get_local_rank()
        if ep > 1:
            self._init_expert_layout(dp_mesh, ep)

    def _init_expert_layout(self, dp_mesh: DeviceMesh, ep: int) -> None:
        """The (edp, ep) grid over the dp ranks: dp_rank = edp_rank x ep + ep_rank (module docstring)."""
        assert self.tp_size == 1, (
            "expert parallelism with tensor parallelism is not built (config refuses it)"
        )
        assert self.args.is_moe and self.args.num_experts % ep == 0 and self.dp_size % ep == 0, (
            f"ep={ep} needs an MoE model whose experts and dp={self.dp_size} it divides (config checks this)"
        )
        # (from the dp mesh, so a dp sub-mesh of a bigger mesh unflattens consistently on every rank)
        expert_mesh = dp_mesh._unflatten(0, (self.dp_size // ep, ep), ("edp", "ep"))
        self.ep_size, self.ep_rank = ep, self.dp_rank % ep
        self.ep_group = expert_mesh.get_group("ep")
        self.edp_mesh = expert_mesh["edp"]

    def placement(self, name: str) -> Placement:
        """Where this rank's block of parameter `name` lies in the whole tensor (parallel.layout.Placement)."""
        if self.ep_size > 1 and is_expert_param(name):
            assert self.edp_mesh is not None
            return Placement(
                0,
                self.ep_rank,
                self.ep_size,
                self.ep_group,
                self.edp_mesh.get_local_rank(),
                self.edp_mesh.size(),
                self.edp_mesh.get_group(),
            )
        dim = shard_dim(name) if self.tp_size > 1 else None
        return Placement(
            dim, self.tp_rank, self.tp_size, self.tp_group, self.shard_rank, self.shard_size, self.shard_group
        )

    def token_stats(self, mb: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the next tokens and entropies [B, T-1] fp32 under softmax(logits / temperature), from the
        hidden states and the LM head chunk by chunk (dockrl.algos.head_logprobs: no [B, T, V] logits; under
        tensor parallelism over this rank's vocab slice, statistics all-reduced over tp).

        Only the response positions go through the head (a prompt's tokens and the padding are never scored,
        and at a real vocabulary the head is a third or more of the work); the grid holds 0 elsewhere. A packed
        micro-batch's model computes its rows end to end (no padding); the same positions are scored."""
        targets = mb.input_ids[:, 1:]  # [B, T-1]
        rows, width = targets.shape
        scored = response_positions(mb)  # [N] indices into the flat [B (T-1)] grid
        packing = mb.packing
        # [N] where those positions' hidden states are in the model's flattened output
        hidden_at = scored if packing is None else packed_response_positions(mb)

        def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if packing is None:
                hidden = hidden[:, :-1]  # [B, T-1, H]: the last column predicts nothing
            flat = hidden.reshape(-1, hidden.shape[-1])  # [B (T-1), H], or packed [S, H]
            logp, entropy = head_token_stats(
                flat.index_select(0, hidden_at),
                weight,
                targets.reshape(-1).index_select(0, scored),
                temperature,
                vocab_start=self.vocab_start,
                group=self.tp_group,
                kernels=self.head_kernels,
            )  # [N] each
            grid = flat.new_zeros(rows * width, dtype=torch.float32)
            # [B (T-1)] each: flat, so FSDP2's root output is not a view
            return grid.index_copy(0, scored, logp), grid.index_copy(0, scored, entropy)

        if self.context is not None:
            return context_passes.token_stats(self, mb, temperature, scored)
        with self.autocast():
            logp, entropy = self.model(mb.model_input_ids(), head=head, **mb.model_inputs())
        return logp.view(rows, width), entropy.view(rows, width)

    def support_stats(
        self, mb: MicroBatch, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `token_stats`, plus the log-probs [B, T-1, k] fp32 of the teacher's top-k ids `mb.topk_ids` (top-k
        distillation: the student's side of the KL), from the same fused head and logsumexp."""
        assert mb.topk_ids is not None, "support_stats reads the teacher's top-k ids (make_micro_batch)"
        targets = mb.input_ids[:, 1:]  # [B, T-1]
        rows, width = targets.shape
        k = mb.topk_ids.shape[-1]
        scored = response_positions(mb)  # [N]
        if self.context is not None:
            return context_passes.support_stats(self, mb, temperature, scored)
        support = mb.topk_ids.reshape(rows * width, k).index_select(0, scored)  # [N, k]

        def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
            flat = hidden[:, :-1].reshape(rows * width, hidden.shape[-1])  # [B (T-1), H]
            logp, entropy, support_logp = head_support_stats(
                flat.index_select(0, scored),
                weight,
                targets.reshape(-1).index_select(0, scored),
                support,
                temperature,
                vocab_start=self.vocab_start,
                group=self.tp_group,
                kernels=self.head_kernels,
            )  # [N], [N], [N, k]
            grid = flat.new_zeros(rows * width, dtype=torch.float32)
            support_grid = flat.new_zeros(rows * width, k, dtype=torch.float32)
            return (
                grid.index_copy(0, scored, logp),
                grid.index_copy(0, scored, entropy),
                support_grid.index_copy(0, scored, support_logp),
            )

        with self.autocast():
            logp, entropy, support_logp = self.model(mb.input_ids, head=head)
        return logp.view(rows, width), entropy.view(rows, width), support_logp.view(rows, width, k)

    @torch.no_grad()
    def top_k_logprobs(
        self,
        prompts: list[torch.Tensor],
        responses: list[torch.Tensor],
        k: int,
        *,
        temperature: float,
        micro_batch_size: int,
        pad_token_id: int,
        max_tokens_per_micro_batch: int = 0,
        num_ids: int | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per row: the response tokens' log-probs [R_i], the k most likely ids [R_i, k] int32 at each response
        position and their log-probs [R_i, k] fp32 (a teacher's, for top-k distillation), under
        softmax(logits / temperature) over the whole vocabulary; the ids among those < `num_ids`. Micro-batches
        and the collective lockstep as in `logprobs`."""
        self.model.eval()
        temp = temperature if temperature > 0 else 1.0
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(prompts)
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        chunks = micro_batch_rows(lengths, micro_batch_size, max_tokens_per_micro_batch * self.cp_size)
        total = self.common_count(len(chunks))
        for idx in chunks:
            mb = make_micro_batch(
                [prompts[i] for i in idx],
                [responses[i] for i in idx],
                pad_token_id=pad_token_id,
                device=self.device,
            )
            logp, ids, top = self._top_k_pass(mb, k, temp, num_ids)  # [N], [N, k], [N, k]
            ends = torch.tensor(mb.lengths).cumsum(0).tolist()
            for i, start, end in zip(idx, [0, *ends[:-1]], ends):
                out[i] = (logp[start:end].clone(), ids[start:end].to(torch.int32), top[start:end].clone())
        for _ in range(total - len(chunks)):  # a rank with fewer rows keeps pace
            self._top_k_pass(self.idle_micro_batch(pad_token_id), k, temp, num_ids)
        rows = cast(list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], out)  # every row is in one chunk
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]

    def _top_k_pass(
        self, mb: MicroBatch, k: int, temperature: float, num_ids: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward of `top_k_logprobs`: per response token, row by row, its log-prob [N], the top-k ids
        [N, k] and their log-probs [N, k] (on CPU)."""
        targets = mb.input_ids[:, 1:]  # [B, T-1]
        rows, width = targets.shape
        scored = response_positions(mb)  # [N]
        if self.context is not None:
            return context_passes.top_k_pass(self, mb, k, temperature, num_ids, scored)

        def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
            flat = hidden[:, :-1].reshape(rows * width, hidden.shape[-1])  # [B (T-1), H]
            return head_top_k(
                flat.index_select(0, scored),
                weight,
                targets.reshape(-1).index_select(0, scored),
                k,
                temperature,
                vocab_start=self.vocab_start,
                group=self.tp_group,
                num_ids=num_ids,
                kernels=self.head_kernels,
            )

        with self.autocast():
            logp, ids, top = self.model(mb.input_ids, head=head)
        return logp.cpu(), ids.cpu(), top.cpu()

    def adapters_off(self):
        """A context in which the model is its base (LoRA's reference policy: the same weights, adapters off);
        a no-op without LoRA."""
        return adapters_disabled(self.model) if self.lora is not None else nullcontext()

    @contextmanager
    def starting_adapters(self) -> Iterator[None]:
        """A context in which the adapters hold the values the engine loaded (model.lora_path's: the KL reference
        of algo.kl_reference=adapter); the trained values come back on exit, bit for bit, the optimizer state
        untouched. Needs `keep_starting_adapters`."""
        if self._starting_adapters is None:
            raise RuntimeError("starting_adapters needs TrainEngine(keep_starting_adapters=True)")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            trained = {name: params[name].detach().clone() for name in self._starting_adapters}
            for name, value in self._starting_adapters.items():
                params[name].copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in trained.items():
                    params[name].copy_(value)

    def autocast(self):
        """bf16 autocast for the unsharded path (FSDP2's mixed-precision policy covers the sharded one)."""
        if self.mesh is None and self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def logits(self, mb: MicroBatch) -> torch.Tensor:
        """Forward pass: logits on the shifted grid [B, T-1, V] (a value model's values [B, T-1]); a packed
        micro-batch's model computes its rows end to end, and its outputs go onto the grid."""
        if self.context is not None:
            return context_passes.outputs(self, mb)
        with self.autocast():
            if mb.packing is None:
                return self.model(mb.input_ids, **mb.model_inputs())[:, :-1]
            return mb.from_packed(self.model(mb.packing.input_ids, **mb.model_inputs()))

    @torch.no_grad()
    def logprobs(
        self,
        prompts: list[torch.Tensor],
        responses: list[torch.Tensor],
        *,
        temperature: float,
        micro_batch_size: int,
        pad_token_id: int,
        max_tokens_per_micro_batch: int = 0,
        with_entropy: bool = False,
        routes: list[torch.Tensor] | None = None,
        replay: bool = False,
        images: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-row response log-probs [R_i] (and entropies) under softmax(logits / temperature), in row order;
        micro-batches as `batch.micro_batch_rows` forms them. MoE `routes` (the rollout's experts per row):
        with `replay` the forwards use them (algo.routing_replay=r3); either way `routing_stats` counts how
        often the router's own top-k is the rollout's. `images` (a vision model): per row its uint8 patches and
        grid (the dock's image_patches, image_grid_thw)."""
        self.model.eval()
        logps: list[torch.Tensor | None] = [None] * len(prompts)
        ents: list[torch.Tensor | None] = [None] * len(prompts)
        temp = temperature if temperature > 0 else 1.0
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        # the budget is per rank: under context parallelism a rank holds 1/cp of each (padded) row
        chunks = micro_batch_rows(
            lengths,
            micro_batch_size,
            max_tokens_per_micro_batch * self.cp_size,
            self.packing,
        )
        # Agree on the count first: every forward is collective under FSDP, and a rank that reached this
        # all-reduce while a peer still ran forwards would wait in a different collective than the peer's.
        total = self.common_count(len(chunks))
        self.routing_stats = RoutingStats.empty(self.args) if routes is not None else None
        for idx in chunks:
            mb = make_micro_batch(
                [prompts[i] for i in idx],
                [responses[i] for i in idx],
                pad_token_id=pad_token_id,
                device=self.device,
                routes=None if routes is None else [routes[i] for i in idx],
                moe_layers=self.args.moe_layers,
                packed=self.packing,
                images=None if images is None else [images[i] for i in idx],
                vision=self.vision,
            )
            with self.routes_context(mb, replay) as seen:
                logp, entropy = self.token_stats(mb, temp)  # [B, T-1] each
            if seen is not None and self.routing_stats is not None:
                assert mb.routes is not None and mb.route_mask is not None
                self.routing_stats.add(seen, mb.routes, mb.route_mask)
            for i, row_logp, row_entropy in zip(idx, mb.unpad(logp), mb.unpad(entropy)):
                logps[i], ents[i] = row_logp, row_entropy
        for _ in range(total - len(chunks)):  # a rank with fewer rows keeps pace
            self.token_stats(self.idle_micro_batch(pad_token_id), temp)
        # Every row is in exactly one chunk, so no None is left.
        rows_logps = cast(list[torch.Tensor], logps)
        return rows_logps, cast(list[torch.Tensor], ents) if with_entropy else None

    def routes_context(self, mb: MicroBatch, replay: bool):
        """MoE: a context in which the forwards (and the recomputes of activation checkpointing inside it) replay
        `mb.routes` (replay) or record the model's own experts; nullcontext(None) without routes."""
        if mb.routes is None:
            return nullcontext(None)
        return routing(self.model, Routing(replay=mb.routes if replay else None, record=True))

    def _router_logits(self):
        """MoE: a context collecting the router logits of the forwards inside; nullcontext(None) if dense."""
        return router_logits(self.model) if self.args.is_moe else nullcontext(None)

    def _aux_loss(self, logits: list[torch.Tensor], mb: MicroBatch, with_grad: bool) -> torch.Tensor:
        """The load-balancing loss of one micro-batch's forward (its first num-MoE-layers logits: a recompute
        appends more) over its tokens."""
        logits = logits[: len(self.args.moe_layers)]
        if not with_grad:
            logits = [x.detach() for x in logits]
        mask = mb.token_mask().reshape(-1)
        return load_balancing_loss(logits, self.args.num_experts_per_tok, self.args.num_experts, mask)

    def common_count(self, count: int) -> int:
        """The most micro-batches any data-parallel rank has (each forward is collective under FSDP, so every
        rank runs that many; the ones with fewer rows add idle micro-batches)."""
        if self.dp_group is None or not dist.is_initialized() or dist.get_world_size(self.dp_group) == 1:
            return count
        counts = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(counts.item())

    def idle_micro_batch(
        self, pad_token_id: int, per_token_names: tuple[str, ...] = (), top_k: int = 0
    ) -> MicroBatch:
        """A one-token micro-batch whose token is masked out: a forward (and backward) that adds nothing to
        the loss, its normalisers or the gradients, for a rank with fewer rows than its peers. `top_k` > 0:
        with a teacher's top-k of that many ids (top-k distillation's passes)."""
        pad = torch.tensor([pad_token_id])
        topk = ([torch.zeros(1, top_k, dtype=torch.int32)], [torch.zeros(1, top_k)]) if top_k else None
        return make_micro_batch(
            [pad],
            [pad],
            pad_token_id=pad_token_id,
            device=self.device,
            per_token={name: [torch.zeros(1)] for name in per_token_names},
            response_masks=[torch.zeros(1)],
            teacher_topk=topk,
            packed=self.packing,
        )

    def train_step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        forward: Callable[[MicroBatch], Any] | None = None,
        replay: bool = False,
        aux_loss_coef: float = 0.0,
    ) -> dict[str, float]:
        """Accumulate gradients over the micro-batches, clip, take one optimizer step; returns summed metrics.
        `loss_fn(forward(mb), mb)` per micro-batch; `forward` defaults to `logits`. MoE micro-batches with the
        rollout's routes: `replay` uses them (r3); either way `routing_stats` counts the router's agreement.
        MoE: each micro-batch's router load-balancing loss (models.moe.load_balancing_loss over its tokens) is
        summed into moe_aux_loss (with moe_aux_count micro-batches), and `aux_loss_coef` x its mean over this
        rank's micro-batches with tokens joins the loss (FSDP2 then averages over ranks)."""
        assert self.optimizer is not None, "train_step on a frozen engine"
        assert self.scheduler is not None  # built with the optimizer
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        forward = forward or self.logits
        totals: dict[str, float] = {}
        with_routes = any(mb.routes is not None for mb in micro_batches)
        scored = sum(
            bool(mb.response_mask.any()) for mb in micro_batches
        )  # not idle: they carry the aux loss
        self.routing_stats = RoutingStats.empty(self.args) if with_routes else None
        for mb in micro_batches:
            # backward inside: recomputes replay the same experts
            with (
                self._kept_unsharded(len(micro_batches) == 1),
                self.routes_context(mb, replay) as seen,
                self._router_logits() as logits,
            ):
                loss, metrics = loss_fn(forward(mb), mb)
                if logits is not None and bool(mb.response_mask.any()):  # not an idle micro-batch
                    aux = self._aux_loss(logits, mb, with_grad=aux_loss_coef > 0)
                    metrics = {**metrics, "moe_aux_loss": float(aux.detach()), "moe_aux_count": 1.0}
                    if aux_loss_coef > 0:
                        loss = loss + aux_loss_coef * aux / scored
                loss.backward()
            if seen is not None and self.routing_stats is not None:
                assert mb.routes is not None and mb.route_mask is not None
                self.routing_stats.add(seen, mb.routes, mb.route_mask)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else math.inf
        if self.tp_size > 1 or self.ep_size > 1:
            grad_norm = self._clip_grad_norm(max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            grad_norm = float(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        totals["grad_norm"] = grad_norm
        totals["lr"] = cast(float, self.scheduler.get_last_lr()[0])  # a tensor only for a tensor lr
        self.scheduler.step()
        return totals

    @contextmanager
    def _kept_unsharded(self, single: bool) -> Iterator[None]:
        """With `single` (the step's only micro-batch) FSDP2 keeps each layer's gathered weights from its forward
        to its backward instead of freeing them after the forward and gathering them again in the backward: one
        all-gather per layer per step instead of two, the same values (its post-backward frees them as before).
        The whole model is unsharded at once for that while, as the rollout's switch holds it anyway."""
        from torch.distributed.fsdp import FSDPModule

        if not single or not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_reshard_after_forward(False)
        try:
            yield
        finally:  # the layers free after forward again; the root keeps its own (FSDP2's default for a root)
            self.model.set_reshard_after_forward(True)
            self.model.set_reshard_after_forward(False, recurse=False)

    def skip_step(self) -> None:
        """A step with nothing to train on: no optimizer step, but the LR schedule advances as if taken (the
        schedule follows the run's step count). torch warns when a schedule steps before any optimizer step;
        here that is the point, so the warning is silenced."""
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            assert self.scheduler is not None, "skip_step on a frozen engine"
            self.scheduler.step()

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over dp x tp (tp-replicated parameters counted once; the expert and dense
        parameters' FSDP2 shards live on different meshes, which torch's clip_grad_norm_ cannot mix); clips
        in place."""
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            grads.append(param.grad)
            local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if self.tp_rank == 0 or name not in self.replicated:
                square += local.double().pow(2).sum()
        for group in (self.shard_group, self.tp_group):
            if group is not None:
                dist.all_reduce(square, group=group)
        norm = float(square.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 CPU state dict (a collective: every rank must call it)."""
        out = {}
        for name, tensor in self.model.state_dict().items():
            out[name] = full_tensor(tensor, self.placement(name)).detach().to("cpu", torch.float32)
        return out


def _frozen_to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Hold every frozen parameter (LoRA's base) in `dtype` (before sharding, on the meta device): it takes no
    gradient and no optimizer state, so it needs no fp32 master copy."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.requires_grad and param.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))


def fully_shard_layers(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    precision: str,
    expert_mesh: DeviceMesh | None = None,
    unit_params: int = 0,
) -> None:
    """FSDP2 over `mesh`: a unit per group of consecutive decoder layers holding at least `unit_params` parameters
    (`parallel.fsdp_units`; 0: a unit per layer), the rest at the root; with `expert_mesh` (expert
    parallelism) each MoE layer's experts are a unit of their own sharded over it (their gradients come out
    averaged over dp like the rest's: see dockrl.parallel.expert_parallel)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )
    layers = list(_decoder(model).layers)
    for layer in layers:
        if expert_mesh is not None and isinstance(layer.mlp, MoEBlock):
            fully_shard(layer.mlp.experts, mesh=expert_mesh, mp_policy=mp)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    for unit in fsdp_units(sizes, unit_params):
        group = layers[unit.start : unit.stop]
        fully_shard(group[0] if len(group) == 1 else group, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _decoder(model: torch.nn.Module) -> DecoderModel:
    """The decoder body (`.model`) of a module a ModelKind builds: a Transformer's, a ValueModel's."""
    return cast(DecoderModel, model.model)


def _lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
