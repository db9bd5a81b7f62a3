"""TrainEngine's passes over a sequence split over the cp ranks (context parallelism: actor.cp, critic.cp,
distill.cp; dockrl.parallel.context). Each runs this rank's zig-zag chunks of every row at their global positions
and puts its positions' results onto the whole grid, summed over cp, so every cp rank returns what one process
would: `token_stats` (log-probs and entropies), `support_stats` (plus top-k distillation's support log-probs),
`top_k_pass` (a teacher's top-k, no gradient) and `outputs` (a value model's values at every position).

Shapes: B rows, T tokens (the shifted grid T-1), Tl tokens on this rank, n of them scored, H hidden, k top-k ids.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dockrl.algos.head_logprobs import HeadKernels, head_support_stats, head_token_stats, head_top_k
from dockrl.engines.train.batch import MicroBatch
from dockrl.parallel.context import ContextShard, cp_sum, local_sequence, local_tokens, spread


class TrainEngine(Protocol):
    """What these passes read of `dockrl.engines.train.train_engine.TrainEngine` (named here, not imported:
    train_engine imports this module)."""

    model: Any
    context: ContextShard | None
    tp_group: dist.ProcessGroup | None
    vocab_start: int

    @property
    def head_kernels(self) -> HeadKernels | None: ...

    def autocast(self) -> AbstractContextManager[Any]: ...


def support_stats(
    engine: TrainEngine, mb: MicroBatch, temperature: float, scored: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`TrainEngine.support_stats` of a sequence split over the cp ranks: as `token_stats`, plus the log-probs of
    the teacher's top-k ids at this rank's scored positions; the three grids are summed over cp (cp_sum)."""
    assert engine.context is not None and mb.topk_ids is not None
    rows, width = mb.input_ids.shape[0], mb.input_ids.shape[1] - 1
    k = mb.topk_ids.shape[-1]
    local = local_tokens(mb.input_ids, scored, engine.context)
    support = mb.topk_ids.reshape(rows * width, k).index_select(0, local.grid_index)  # [n, k]

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = hidden.reshape(-1, hidden.shape[-1])  # [B Tl, H]
        logp, entropy, support_logp = head_support_stats(
            flat.index_select(0, local.hidden_index),
            weight,
            local.targets,
            support,
            temperature,
            vocab_start=engine.vocab_start,
            group=engine.tp_group,
            kernels=engine.head_kernels,
        )  # [n], [n], [n, k]
        grid = flat.new_zeros(rows * width, dtype=torch.float32)
        support_grid = flat.new_zeros(rows * width, k, dtype=torch.float32)
        return (
            grid.index_copy(0, local.grid_index, logp),
            grid.index_copy(0, local.grid_index, entropy),
            support_grid.index_copy(0, local.grid_index, support_logp),
        )

    positions = local.positions.expand(rows, -1)  # [B, Tl]
    with engine.autocast():
        logp, entropy, support_logp = engine.model(local.input_ids, position_ids=positions, head=head)
    group = engine.context.group
    return (
        cp_sum(logp, group).view(rows, width),
        cp_sum(entropy, group).view(rows, width),
        cp_sum(support_logp, group).view(rows, width, k),
    )


def top_k_pass(
    engine: TrainEngine, mb: MicroBatch, k: int, temperature: float, num_ids: int | None, scored: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`TrainEngine._top_k_pass` of a sequence split over the cp ranks: each rank scores its own positions, and the
    parts go onto the flat [B (T-1)] grid, summed over cp (no gradient: a plain all-reduce), so every cp rank
    returns every response token's, in `scored` order."""
    assert engine.context is not None
    cells = mb.input_ids.shape[0] * (mb.input_ids.shape[1] - 1)
    local = local_tokens(mb.input_ids, scored, engine.context)

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = hidden.reshape(-1, hidden.shape[-1])  # [B Tl, H]
        return head_top_k(
            flat.index_select(0, local.hidden_index),
            weight,
            local.targets,
            k,
            temperature,
            vocab_start=engine.vocab_start,
            group=engine.tp_group,
            num_ids=num_ids,
            kernels=engine.head_kernels,
        )  # [n], [n, k], [n, k]

    positions = local.positions.expand(mb.input_ids.shape[0], -1)  # [B, Tl]
    with engine.autocast():
        parts = engine.model(local.input_ids, position_ids=positions, head=head)
    whole = []
    for part in parts:
        grid = part.new_zeros(cells, *part.shape[1:]).index_copy(0, local.grid_index, part)
        dist.all_reduce(grid, group=engine.context.group)  # disjoint positions: the sum is a gather
        whole.append(grid.index_select(0, scored).cpu())
    return whole[0], whole[1], whole[2]


def token_stats(
    engine: TrainEngine, mb: MicroBatch, temperature: float, scored: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`TrainEngine.token_stats` of a sequence split over the cp ranks (dockrl.parallel.context): this rank's zig-zag
    chunks run at their global positions, the head scores its own scored positions, and the ranks' parts
    of the [B, T-1] grids are summed over cp, so every cp rank returns the whole grids."""
    assert engine.context is not None
    rows, width = mb.input_ids.shape[0], mb.input_ids.shape[1] - 1
    local = local_tokens(mb.input_ids, scored, engine.context)

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, hidden.shape[-1])  # [B Tl, H]
        logp, entropy = head_token_stats(
            flat.index_select(0, local.hidden_index),
            weight,
            local.targets,
            temperature,
            vocab_start=engine.vocab_start,
            group=engine.tp_group,
            kernels=engine.head_kernels,
        )  # [n] each
        grid = flat.new_zeros(rows * width, dtype=torch.float32)
        return grid.index_copy(0, local.grid_index, logp), grid.index_copy(0, local.grid_index, entropy)

    positions = local.positions.expand(rows, -1)  # [B, Tl]
    with engine.autocast():
        logp, entropy = engine.model(local.input_ids, position_ids=positions, head=head)
    group = engine.context.group
    return cp_sum(logp, group).view(rows, width), cp_sum(entropy, group).view(rows, width)


def outputs(engine: TrainEngine, mb: MicroBatch) -> torch.Tensor:
    """`TrainEngine.logits` of a sequence split over the cp ranks (a value model's values [B, T-1]): this rank's zig-zag
    chunks run at their global positions, and every cp rank gets the whole shifted grid (context.spread)."""
    assert engine.context is not None
    ids, positions = local_sequence(mb.input_ids, engine.context)  # [B, Tl], [Tl]
    with engine.autocast():
        local = engine.model(ids, position_ids=positions.expand(ids.shape[0], -1))  # [B, Tl, ...]
    return spread(local, positions, mb.input_ids.shape[1] - 1, engine.context.group)
