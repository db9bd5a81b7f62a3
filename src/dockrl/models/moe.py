"""Mixture-of-experts MLP of the Qwen3-MoE family, numerically matching transformers' `Qwen3MoeSparseMoeBlock`.

```
 x [N, H] ─ gate (router, nn.Linear H -> E) ─ softmax (fp32) ─ top-k (values, experts) ─ renormalise (norm_topk_prob)
          └─ experts: the N*k (token, expert) pairs sorted by expert; one SwiGLU matmul chain per expert over its
             tokens; each output times its routing weight; summed back per token (index_add, expert order)
```

Parameter layout (transformers 5's, in memory): `mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj`
[E, 2I, H] (gate rows first, then up), `mlp.experts.down_proj` [E, H, I]. Checkpoints on disk (the hub's
Qwen3-MoE files, and what dockrl writes) keep one tensor per expert and projection,
`mlp.experts.{e}.{gate,up,down}_proj.weight`; `dockrl.models.hf` converts between the two (`fuse_experts`,
`split_experts`).

Routing replay (`Routing`): a forward run inside `routing(model, Routing(...))` can record each MoE layer's
top-k experts and/or replay given ones; replayed experts are weighted by this model's own router probabilities
over them (renormalised like the top-k), so gradients still reach the router.

Shape letters: N tokens (batch x time, flattened), H hidden size, E experts, k experts per token, I expert width.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dockrl.models.config import ModelArgs


@dataclass
class Routing:
    """What the MoE layers of the forwards run under `routing(model, ...)` do with their top-k choices.

    replay: MoE layer index -> experts [B, T, k] (int) to use instead of the router's top-k.
    record: keep each layer's chosen experts [B, T, k] (after replay: what was used) in `recorded`, and the
        router's own top-k in `routed` (they differ only under replay).
    """

    replay: dict[int, torch.Tensor] | None = None
    record: bool = False
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)
    routed: dict[int, torch.Tensor] = field(default_factory=dict)

    def choose(self, layer: int, top: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The experts layer `layer` uses for its tokens: top [N, k] (the router's), or the replayed ones."""
        used = top
        if self.replay is not None and layer in self.replay:
            used = self.replay[layer].reshape(top.shape).to(top.device, torch.int64)
        if self.record:
            self.recorded[layer] = used.reshape(*shape, -1).detach()
            self.routed[layer] = top.reshape(*shape, -1).detach()
        return used


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x forward; its gradient times `factor` backward."""
    return _ScaleGrad.apply(x, factor)


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D parameters (see the module docstring). Under expert parallelism
    (`dockrl.parallel.expert_parallel`) a subclass holds this rank's experts only and overrides `dispatch`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        experts, hidden, width = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], experts [N, k] (int), weights [N, k] -> [N, H]: sum over k of weight x expert(x)."""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
        tokens = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        out = self.dispatch(x[tokens], counts)  # [N*k, H], same order
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, H] grouped by expert (counts [E] rows each) -> each row through its expert, same order."""
        return self.grouped(rows, counts.tolist())

    def grouped(self, rows: torch.Tensor, counts: list[int], grad_scale: float = 1.0) -> torch.Tensor:
        """rows grouped by this module's experts in order (counts[j] rows for its j-th) -> their outputs: one
        SwiGLU matmul chain per expert with rows. `grad_scale` scales the weights' gradients (expert
        parallelism: see dockrl.parallel.expert_parallel)."""
        gate_up_proj: torch.Tensor = self.gate_up_proj
        down_proj: torch.Tensor = self.down_proj
        if grad_scale != 1.0:
            gate_up_proj, down_proj = scale_grad(gate_up_proj, grad_scale), scale_grad(down_proj, grad_scale)
        pieces = []
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            chunk = rows[start : start + count]
            gate, up = F.linear(chunk, gate_up_proj[expert]).chunk(2, dim=-1)
            pieces.append(F.linear(F.silu(gate) * up, down_proj[expert]))
            start += count
        if not pieces:  # no rows here (an expert-parallel rank nobody routed to): still a zero gradient for
            # the experts, so every rank reduces the same gradients (FSDP2)
            return rows[:0] + 0.0 * (gate_up_proj.sum() + down_proj.sum())
        return torch.cat(pieces)


class MoEBlock(nn.Module):
    """Router + experts at a decoder layer's `mlp` (transformers' Qwen3MoeSparseMoeBlock)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args)
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.layer = layer
        self.routing: Routing | None = None  # set by `routing(model, ...)` for the forwards inside it
        self.router_log: list[torch.Tensor] | None = (
            None  # set by `router_logits(model)`: logits [N, E] go here
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        batch, time, hidden = x.shape
        flat = x.reshape(-1, hidden)
        logits = self.gate(flat)  # [N, E]
        if self.router_log is not None:
            self.router_log.append(logits)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_values, top = torch.topk(probs, self.top_k, dim=-1)
        routing = self.routing
        if routing is not None:
            used = routing.choose(self.layer, top, (batch, time))
            if used is not top:
                top, top_values = used, probs.gather(-1, used)
        if self.norm_topk_prob:
            top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        out = self.experts(flat, top, top_values.to(logits.dtype))
        return out.reshape(batch, time, hidden)


@dataclass
class RoutingStats:
    """How often the trainer's router chose the rollout's experts (the same top-k set at a position), and the
    tokens each expert got, summed over forwards (MoE layers together)."""

    agree: float
    total: float
    load: torch.Tensor  # [E] float64

    @classmethod
    def empty(cls, args: ModelArgs) -> RoutingStats | None:
        """Zeros for an MoE model; None for a dense one."""
        return cls(0.0, 0.0, torch.zeros(args.num_experts, dtype=torch.float64)) if args.is_moe else None

    def add(self, seen: Routing, given: dict[int, torch.Tensor], mask: torch.Tensor) -> None:
        """Count the positions `mask` [B, T] marks: the trainer router's own top-k (`seen.routed`) against the
        rollout's `given` experts, and the experts the forward used (`seen.recorded`) into the load."""
        for layer, own in seen.routed.items():
            theirs = given[layer].to(own.device)
            same = (own.sort(dim=-1).values == theirs.sort(dim=-1).values).all(dim=-1) & mask
            self.agree += float(same.sum())
            self.total += float(mask.sum())
            used = seen.recorded[layer][mask].reshape(-1).cpu()
            self.load += torch.bincount(used, minlength=self.load.numel()).double()

    def as_tensor(self) -> torch.Tensor:
        """[agree, total, load...] float64, for an all-reduce over ranks."""
        return torch.cat([torch.tensor([self.agree, self.total], dtype=torch.float64), self.load])


def routing_metrics(summed: torch.Tensor) -> dict[str, float]:
    """moe/routing_agreement (share of positions whose top-k sets agree) and moe/expert_load (max / mean tokens
    per expert) from `RoutingStats.as_tensor()` summed over ranks."""
    agree, total, load = float(summed[0]), float(summed[1]), summed[2:]
    mean = float(load.mean())
    return {
        "moe/routing_agreement": agree / total if total else float("nan"),
        "moe/expert_load": float(load.max()) / mean if mean else float("nan"),
    }


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


@contextmanager
def routing(model: nn.Module, state: Routing) -> Iterator[Routing]:
    """Run the model's forwards inside with `state` recording and/or replaying routes (module docstring)."""
    blocks = moe_blocks(model)
    for block in blocks:
        block.routing = state
    try:
        yield state
    finally:
        for block in blocks:
            block.routing = None


@contextmanager
def router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect every MoE layer's router logits [N, E] of the forwards run inside, in call order (an
    activation-checkpointing recompute appends again)."""
    log: list[torch.Tensor] = []
    blocks = moe_blocks(model)
    for block in blocks:
        block.router_log = log
    try:
        yield log
    finally:
        for block in blocks:
            block.router_log = None


def load_balancing_loss(
    router_logits: list[torch.Tensor], top_k: int, num_experts: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch/GShard auxiliary loss transformers' Qwen3-MoE uses: E x sum_e (share of top-k assignments to
    e) x (mean router probability of e), over the tokens of all layers together; `mask` [N] (bool) keeps only
    those rows of every layer's logits (transformers' attention-mask form), None keeps all."""
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_per_expert = torch.zeros_like(tokens_per_expert)
    rows = 0
    for logits in router_logits:
        if mask is not None:
            logits = logits[mask.to(logits.device)]
        probs = F.softmax(logits.float(), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        tokens_per_expert = tokens_per_expert + torch.bincount(chosen.reshape(-1), minlength=num_experts)
        prob_per_expert = prob_per_expert + probs.sum(dim=0)
        rows += probs.shape[0]
    rows = max(rows, 1)
    return num_experts * torch.sum((tokens_per_expert / rows) * (prob_per_expert / rows))
