"""Expert parallelism (MoE, `actor.ep`): each rank of an ep group holds E/ep experts of every MoE layer, and the
tokens travel to their experts and back with all-to-all.

    this rank's N tokens x k slots, sorted by expert ── counts per expert [E] ──all-to-all──▶ counts from
    each source for my experts [ep, E/ep]
    rows grouped by destination rank ──all-to-all (uneven splits)──▶ rows from every source, regrouped by
    my local expert ── one SwiGLU matmul chain per expert ── back in arrival order ──all-to-all──▶ rows in
    the order this rank sent them ── x routing weight, summed per token (models.moe.Experts.forward)

The all-to-alls are differentiable (the backward sends gradients back along the reverse splits), so the
experts' gradients on a rank sum the tokens of all ep sources; FSDP2 then averages them over the edp ranks
holding the same experts (divides by edp), and the weights' uses scale their gradient by 1/ep
(`models.moe.scale_grad`, through `Experts.grouped`),
so they come out averaged over all dp = edp x ep ranks like the dense parameters'. (FSDP2's own
set_gradient_divide_factor would do it in the reduction, but needs PREMUL_SUM, which gloo lacks.)
Parameter names stay Hugging Face's, with [E/ep, ...] local shapes (`dockrl.parallel.layout.Placement`).
gloo on CPU, NCCL on CUDA (the all-to-alls move device tensors; the counts are small int64 tensors).

`ALL_TO_ALL_BYTES` counts what this process sent (row payloads, forward and backward; the counts are not
counted): the actor reports it per step as moe/all_to_all_mb.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dockrl.models.hf import FUSED_EXPERT_SUFFIXES
from dockrl.models.moe import Experts, moe_blocks
from dockrl.models.tp_plan import shard_range

ALL_TO_ALL_BYTES = [0]  # a one-item list: bytes this process sent through `all_to_all` (forward + backward)


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    ALL_TO_ALL_BYTES[0] += x.numel() * x.element_size()
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows x[sum(in_splits[:j]) : ...] go to group rank j; returns the rows every rank sent here, by source
    rank (out_splits[j] from rank j). Differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ParallelExperts(Experts):
    """Experts [first, first + E/ep) of an MoE layer on rank `rank` of the ep `group`."""

    def __init__(self, experts: Experts, rank: int, size: int, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)
        self.num_experts = experts.num_experts
        self.rank, self.size, self.group = rank, size, group
        start, end = shard_range(experts.num_experts, rank, size)
        self.num_local = end - start
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, name)
            local = whole.detach()[start:end].clone()
            setattr(self, name, nn.Parameter(local, whole.requires_grad))

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, H] grouped by (global) expert, counts [E] -> outputs from whichever rank holds each."""
        size, local = self.size, self.num_local
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=self.group)  # [ep sources x E/ep local experts]
        arriving = arriving.view(size, local)
        send = counts.view(size, local).sum(dim=1).tolist()
        receive = arriving.sum(dim=1).tolist()
        received = all_to_all(rows, receive, send, self.group)  # by source, then by local expert
        expert_of_row = torch.arange(local, device=rows.device).repeat(size)
        expert_of_row = expert_of_row.repeat_interleave(arriving.reshape(-1).to(rows.device))
        order = torch.argsort(expert_of_row, stable=True)  # by local expert, then source
        out = self.grouped(received[order], arriving.sum(dim=0).tolist(), 1.0 / size)
        out = out[torch.argsort(order)]  # back in arrival order
        return all_to_all(out, send, receive, self.group)


def parallelize_experts(model: nn.Module, rank: int, size: int, group: dist.ProcessGroup) -> None:
    """Replace every MoE layer's experts by this rank's E/size of them (on the meta device, before FSDP2)."""
    for block in moe_blocks(model):
        if block.experts.num_experts % size:
            raise ValueError(
                f"expert-parallel size {size} does not divide {block.experts.num_experts} experts"
            )
        block.experts = ParallelExperts(block.experts, rank, size, group)


def is_expert_param(name: str) -> bool:
    """Whether parameter `name` holds experts (split over ep along dim 0)."""
    return name.endswith(FUSED_EXPERT_SUFFIXES)
