"""Tensor parallelism on dockrl's decoder (Megatron-style, explicit collectives, plain local tensors).

`parallelize(model, tp_rank, tp_size, group)` replaces every split parameter (see `dockrl.models.tp_plan`) by
this rank's slice and wires the collectives:

    norm output ──copy_to_tp──▶ column-parallel q/k/v, gate/up (local heads / columns, no communication)
                                  └──▶ row-parallel o/down: local matmul ──reduce_from_tp (all-reduce)──▶ + bias
    ids ──▶ vocab-parallel embedding: rows of this rank's vocab slice, zero elsewhere ──reduce_from_tp──▶
    final norm ──copy_to_tp──▶ LM head: logits of this rank's vocab slice [B, T, V/tp]

copy_to_tp is the identity forward and an all-reduce of the gradient backward; reduce_from_tp the reverse.
Replicated parameters therefore get identical gradients on every tp rank, except q_norm/k_norm (qwen3),
which see only local heads: they pass their weight through copy_to_tp so autograd sums the head
contributions across ranks. Parameter names stay Hugging Face's, so FSDP2 and checkpoints see the same tree.
Training never forms logits: log-probs come from the hidden states and this rank's slice of the LM head
(`dockrl.algos.head_logprobs`, statistics all-reduced over tp); an inference model built with
`gather_logits=True` all-gathers its logit slices so the sampler sees the full vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dockrl.models.decoder import MLP, RMSNorm, Transformer
from dockrl.models.lora import LoRALinear
from dockrl.models.rms_norm import rms_norm
from dockrl.models.tp_plan import shard_range, tp_problem


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over `group` backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) over `group` forward; identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (inference only: no gradient)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _slice_param(param: torch.Tensor, dim: int, rank: int, size: int) -> nn.Parameter:
    start, end = shard_range(param.shape[dim], rank, size)
    return nn.Parameter(param.detach().narrow(dim, start, end - start).clone(), param.requires_grad)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b; weight [out, in/tp], bias [out] replicated.

    With a LoRA base (dockrl.models.lora) the adapter splits like the weight: lora_A [r, in/tp] by columns,
    lora_B [out, r] replicated, and the adapter's partial products join the all-reduce:
    sum_ranks (x_local A_local^T) B^T = (x A^T) B^T. B's gradient is partial per rank (it sees only its rank's
    x_local A_local^T), so B passes through copy_to_tp, which sums it over the group.
    """

    def __init__(self, linear: nn.Linear, rank: int, size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = _slice_param(linear.weight, 1, rank, size)
        self.bias = linear.bias
        self.lora_enabled = False
        if isinstance(linear, LoRALinear):
            self.lora_A = _slice_param(linear.lora_A, 1, rank, size)
            self.lora_B = linear.lora_B
            self.lora_scaling, self.lora_dropout = linear.lora_scaling, linear.lora_dropout
            self.lora_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in/tp] -> [..., out]."""
        partial = F.linear(x, self.weight)  # [..., out]
        if self.lora_enabled:
            if self.training and self.lora_dropout > 0:
                x = F.dropout(x, self.lora_dropout)
            low = F.linear(x.to(self.lora_A.dtype), self.lora_A)  # [..., r], this rank's columns' share
            update = F.linear(low, copy_to_tp(self.lora_B, self.group))
            partial = partial + (self.lora_scaling * update).to(partial.dtype)
        out = reduce_from_tp(partial, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + V/tp) of the embedding; other ids contribute zero before the all-reduce."""

    def __init__(self, embedding: nn.Embedding, rank: int, size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab_start, self.vocab_end = shard_range(embedding.num_embeddings, rank, size)
        self.weight = _slice_param(embedding.weight, 0, rank, size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> [B, T, H]."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return reduce_from_tp(out, self.group)


class HeadSharedNorm(RMSNorm):
    """qwen3's per-head q/k RMSNorm on local heads; its weight's gradient is summed over the tp group."""

    def __init__(self, norm: RMSNorm, group: dist.ProcessGroup) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> same shape and dtype."""
        return rms_norm(x, copy_to_tp(self.weight, self.group), self.eps)


def _shard_linear_rows(linear: nn.Linear, rank: int, size: int, group: dist.ProcessGroup) -> None:
    """Column-parallel: this rank's rows of W and b; a LoRA layer's lora_B rows with them, its lora_A
    replicated with its partial gradient (this rank's output rows only) summed over the group."""
    linear.weight = _slice_param(linear.weight, 0, rank, size)
    if linear.bias is not None:
        linear.bias = _slice_param(linear.bias, 0, rank, size)
    linear.out_features = linear.weight.shape[0]
    if isinstance(linear, LoRALinear):
        linear.lora_B = _slice_param(linear.lora_B, 0, rank, size)
        linear.sync_replicated, linear.replicated_factor = (lambda t: copy_to_tp(t, group)), "lora_A"


def parallelize(
    model: Transformer, tp_rank: int, tp_size: int, group: dist.ProcessGroup, *, gather_logits: bool = False
) -> Transformer:
    """Split `model` in place for rank `tp_rank` of a `tp_size` group (before FSDP2 wraps it)."""
    problem = tp_problem(model.args, tp_size)
    if problem is not None:
        raise ValueError(f"tensor-parallel size {tp_size} {problem}")
    if tp_size == 1:
        return model

    def copy_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(output, group)

    for layer in model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, MLP), (
            "tensor parallelism of MoE layers is not built (config.tp_problem refuses it)"
        )
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _shard_linear_rows(linear, tp_rank, tp_size, group)
        # The parallel modules replace the plain ones in place (same call signature, sharded weights).
        attn.o_proj = RowParallelLinear(attn.o_proj, tp_rank, tp_size, group)  # type: ignore[assignment]
        mlp.down_proj = RowParallelLinear(mlp.down_proj, tp_rank, tp_size, group)  # type: ignore[assignment]
        if attn.q_norm is not None and attn.k_norm is not None:
            attn.q_norm = HeadSharedNorm(attn.q_norm, group)
            attn.k_norm = HeadSharedNorm(attn.k_norm, group)
        layer.input_layernorm.register_forward_hook(copy_output)
        layer.post_attention_layernorm.register_forward_hook(copy_output)
    embedding = VocabParallelEmbedding(model.model.embed_tokens, tp_rank, tp_size, group)
    model.model.embed_tokens = embedding  # type: ignore[assignment]
    if not model.args.tie_word_embeddings:
        _shard_linear_rows(model.lm_head, tp_rank, tp_size, group)
    model.model.norm.register_forward_hook(copy_output)
    if gather_logits:
        model.gather_logits = lambda logits: gather_from_tp(logits, group)
    return model


def replicated_names(model: nn.Module) -> set[str]:
    """Parameters held whole on every tp rank (their gradient norm is counted once, not tp times)."""
    from dockrl.models.tp_plan import shard_dim

    return {name for name, _ in model.named_parameters() if shard_dim(name) is None}
