"""One optimizer step of the clipped-surrogate policy loss over a mini-batch of dock rows.

Shapes: B rows, T tokens (shifted grid T-1), V vocab.

Normalisation across data-parallel ranks: a token-mean loss must divide by the token count of the
whole mini-batch on all ranks, not of this rank's share. The local loss is therefore
sum(local token losses) / global_tokens, and it is multiplied by world_size because FSDP2 averages
gradients over the ranks. Then dp=N and dp=1 take the same step on the same rows. Under context parallelism
(actor.cp) FSDP2 averages over dp x cp ranks, and the cp ranks of one dp rank compute the same loss on the same
rows (engine.token_stats sums their log-prob grids), each backpropagating through its own chunks: the loss is
multiplied by world_size x cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dockrl.algos.advantages import masked_moments, whiten
from dockrl.algos.distill import TEACHER_TAIL_MASS, TOPK_KL, tail_mass, top_k_forward_kl
from dockrl.algos.losses import policy_loss
from dockrl.algos.registry import LossPlan
from dockrl.dock.columns import (
    ADVANTAGES,
    IMAGE_GRID_THW,
    IMAGE_PATCHES,
    LOSS_MASK,
    OLD_LOGPROBS,
    PROMPT_IDS,
    REF_LOGPROBS,
    RESPONSE_IDS,
    ROLLOUT_LOGPROBS,
    ROUTED_EXPERTS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    UPDATE_WEIGHT,
)
from dockrl.engines.train.batch import MicroBatch, make_micro_batch, micro_batch_rows
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.moe import RoutingStats, routing_metrics

SUMMED_METRICS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "clip_frac",
    "clip_frac_high",
    "clip_frac_low",
    "approx_kl",
)
# With the rollout's log-probs in the batch: the trainer-vs-rollout mismatch on the sampled tokens (mean
# |log-prob difference| and KL(rollout || trainer), k3), and the importance weights of algo.rollout_is.
ROLLOUT_METRICS = (
    "rollout/logprob_abs_diff",
    "rollout/kl",
    "rollout/is_weight_mean",
    "rollout/is_capped_frac",
)
# Top-k distillation (the teacher's top-k columns in the batch): the forward KL over the top-k and the tail, and
# the teacher's tail mass, means over the mini-batch's tokens.
DISTILL_METRICS = (TOPK_KL, TEACHER_TAIL_MASS)


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum a small CPU tensor over `group` (default: all ranks; a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def policy_update(
    engine: TrainEngine,
    batch: dict[str, list],
    idx: list[int],
    per_token_names: list[str],
    plan: LossPlan,
    *,
    temperature: float,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int = 0,
    pad_token_id: int,
    world_size: int,
    replay: bool = False,
    aux_loss_coef: float = 0.0,
) -> dict[str, float] | None:
    """Train on rows `idx` of `batch` (prompt_ids, response_ids, advantages [, ref_logprobs, old_logprobs]) with
    the policy loss `plan` (the run's StepPlan.loss, resolved in config); returns the step's metrics, or None
    when no rank had a row (the LR schedule still advances).

    `world_size` is the number of data-parallel ranks; tensor-parallel peers train on the same rows. MoE rows
    with the rollout's experts (`routed_experts`): `replay` (algo.routing_replay=r3) trains with them, and
    moe/routing_agreement and moe/expert_load are measured either way. MoE models also report moe/aux_loss (the
    router's load-balancing loss, mean over micro-batches and ranks), which joins the loss times `aux_loss_coef`
    (actor.moe_aux_loss_coef).
    """
    # Rows a failed reward call left out (reward.on_error=drop_group) weigh 0: masked out of the loss and
    # of its token and sequence counts.
    weights = [float(batch[UPDATE_WEIGHT][i]) for i in idx] if UPDATE_WEIGHT in batch else [1.0] * len(idx)
    # Multi-turn: only the policy's tokens count (loss_mask 1); observation tokens leave the loss, the KL, the
    # entropy and every normaliser.
    masks = None
    if LOSS_MASK in batch:
        masks = [batch[LOSS_MASK][i].float() * w for i, w in zip(idx, weights)]
    elif any(w != 1.0 for w in weights):
        masks = [torch.full((len(batch[RESPONSE_IDS][i]),), w) for i, w in zip(idx, weights)]
    tokens = (
        [float(m.sum()) for m in masks] if masks is not None else [len(batch[RESPONSE_IDS][i]) for i in idx]
    )
    local = [sum(tokens), sum(weights), len(idx)]
    global_tokens, global_seqs, global_rows = all_reduce_sum(torch.tensor(local), engine.dp_group).tolist()
    if global_rows == 0:  # no rank has a row (rollout.partial cut every group): no optimizer step
        engine.skip_step()
        return None
    global_tokens, global_seqs = max(global_tokens, 1.0), max(global_seqs, 1.0)  # all left out: a zero loss
    lengths = [len(batch[PROMPT_IDS][i]) + len(batch[RESPONSE_IDS][i]) for i in idx]
    micro_batches = [
        make_micro_batch(
            [batch[PROMPT_IDS][idx[j]] for j in chunk],
            [batch[RESPONSE_IDS][idx[j]] for j in chunk],
            pad_token_id=pad_token_id,
            device=engine.device,
            per_token={name: [batch[name][idx[j]] for j in chunk] for name in per_token_names},
            response_masks=None if masks is None else [masks[j] for j in chunk],
            # algo.routing_replay=r3: the update's forwards use the rollout's experts
            routes=None if ROUTED_EXPERTS not in batch else [batch[ROUTED_EXPERTS][idx[j]] for j in chunk],
            moe_layers=engine.args.moe_layers,
            teacher_topk=None
            if TEACHER_TOPK_IDS not in batch
            else (
                [batch[TEACHER_TOPK_IDS][idx[j]] for j in chunk],
                [batch[TEACHER_TOPK_LOGPROBS][idx[j]] for j in chunk],
            ),
            packed=engine.packing,
            images=None
            if IMAGE_PATCHES not in batch
            else [(batch[IMAGE_PATCHES][idx[j]], batch[IMAGE_GRID_THW][idx[j]]) for j in chunk],
            vision=engine.vision,
        )
        # the budget is per rank: under context parallelism a rank holds 1/cp of each row
        for chunk in micro_batch_rows(
            lengths, micro_batch_size, max_tokens_per_micro_batch * engine.cp_size, engine.packing
        )
    ]
    # Ranks with fewer rows (rollout.partial trains what finished) keep pace with masked micro-batches.
    idle = engine.common_count(len(micro_batches)) - len(micro_batches)
    top_k = 0
    if TEACHER_TOPK_IDS in batch:  # requested by every rank alike; one without rows learns k from its peers
        top_k = engine.common_count(batch[TEACHER_TOPK_IDS][idx[0]].shape[-1] if idx else 0)
    micro_batches += [
        engine.idle_micro_batch(pad_token_id, tuple(per_token_names), top_k) for _ in range(idle)
    ]
    # FSDP2 averages over the dp x cp ranks; the cp ranks of a dp rank each backpropagate their part of the loss
    loss_fn = _loss_fn(plan, global_tokens, global_seqs, world_size * engine.cp_size)
    forward = engine.support_stats if top_k else engine.token_stats
    metrics = engine.train_step(
        micro_batches,
        loss_fn,
        forward=lambda mb: forward(mb, temperature),
        replay=replay,
        aux_loss_coef=aux_loss_coef,
    )
    keys = [
        k for k in (*SUMMED_METRICS, *ROLLOUT_METRICS, *DISTILL_METRICS) if k in metrics
    ]  # same on all ranks
    totals = all_reduce_sum(torch.tensor([metrics[k] for k in keys], dtype=torch.float64), engine.dp_group)
    out = dict(zip(keys, totals.tolist()))
    if ROUTED_EXPERTS in batch:  # MoE with the rollout's routes: on every rank, so all join the all-reduce
        stats = engine.routing_stats or RoutingStats.empty(engine.args)
        assert stats is not None, "routed_experts come from an MoE model"
        out.update(routing_metrics(all_reduce_sum(stats.as_tensor(), engine.dp_group)))
    if engine.args.is_moe:  # on every rank (one with only idle micro-batches adds 0 of 0), so all join it
        aux = all_reduce_sum(
            torch.tensor(
                [metrics.get("moe_aux_loss", 0.0), metrics.get("moe_aux_count", 0.0)], dtype=torch.float64
            ),
            engine.dp_group,
        ).tolist()
        out["moe/aux_loss"] = aux[0] / max(aux[1], 1.0)
    out["grad_norm"], out["lr"] = metrics["grad_norm"], metrics["lr"]
    return out


def importance_weights(raw: torch.Tensor, plan: LossPlan) -> torch.Tensor:
    """The per-token weights of algo.rollout_is from raw = pi_old / pi_rollout [B, T-1]:
    tis truncates them at the cap (Yao et al. 2025: min(raw, cap)); decoupled (decoupled PPO, AReaL, arXiv
    2505.24298: pi_old is the proximal policy, the rollout's the behaviour policy) masks out the tokens whose
    weight exceeds the cap (weight 0) and keeps the others as they are."""
    if plan.rollout_is == "decoupled":
        return torch.where(raw <= plan.rollout_is_cap, raw, torch.zeros_like(raw))
    return raw.clamp(max=plan.rollout_is_cap)


def _loss_fn(
    plan: LossPlan,
    global_tokens: float,
    global_seqs: float,
    world_size: int,
):
    # stats: engine.token_stats' log-probs and entropies [B, T-1] (the entropy's gradient is kept only when the
    # loss has an entropy bonus); engine.support_stats' add the log-probs [B, T-1, k] of the teacher's top-k.
    def loss_fn(stats: tuple[torch.Tensor, ...], mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp, all_entropy = stats[:2]  # [B, T-1] each
        distill_kl = None
        if len(stats) == 3:
            assert mb.topk_logprobs is not None, "support_stats' micro-batches carry the teacher's top-k"
            distill_kl = top_k_forward_kl(mb.topk_logprobs, stats[2])  # [B, T-1]
        entropy = all_entropy if plan.entropy_coef > 0 else None
        # One optimizer step per RL step (one mini-batch, one epoch): the old policy is the current one.
        old = mb.per_token.get(OLD_LOGPROBS, logp.detach())
        rollout = mb.per_token.get(ROLLOUT_LOGPROBS)  # [B, T-1], the sampling engine's
        raw_weights = None if rollout is None or plan.rollout_is == "none" else (old - rollout).exp()
        is_weights = None if raw_weights is None else importance_weights(raw_weights, plan)
        out = policy_loss(
            logp,
            old,
            mb.per_token[ADVANTAGES],
            mb.response_mask,
            plan,
            ref_logprobs=mb.per_token.get(REF_LOGPROBS),
            entropy=entropy,
            num_tokens=global_tokens,
            num_seqs=global_seqs,
            is_weights=is_weights,
            distill_kl=distill_kl,
        )
        if entropy is None:
            entropy_value = (all_entropy.detach() * mb.response_mask).sum().item() / global_tokens
        else:
            entropy_value = out.entropy.item()
        share = mb.response_mask.sum().item() / global_tokens  # weight of this micro-batch's token means
        metrics = {
            "loss": out.loss.item(),
            "pg_loss": out.pg_loss.item(),
            "kl": out.kl.item(),
            "entropy": entropy_value,
            "clip_frac": out.clip_frac.item() * share,
            "clip_frac_high": out.clip_frac_high.item() * share,
            "clip_frac_low": out.clip_frac_low.item() * share,
            "approx_kl": out.approx_kl.item() * share,
        }
        if distill_kl is not None:
            assert mb.topk_logprobs is not None
            mask = mb.response_mask
            metrics[TOPK_KL] = (distill_kl.detach() * mask).sum().item() / global_tokens
            metrics[TEACHER_TAIL_MASS] = (tail_mass(mb.topk_logprobs) * mask).sum().item() / global_tokens
        if rollout is not None:
            mask = mb.response_mask
            metrics.update(_rollout_metrics(logp.detach(), rollout, raw_weights, plan, mask, global_tokens))
        return out.loss * world_size, metrics

    return loss_fn


def _rollout_metrics(
    logp: torch.Tensor,
    rollout: torch.Tensor,
    raw_weights: torch.Tensor | None,
    plan: LossPlan,
    mask: torch.Tensor,
    global_tokens: float,
) -> dict[str, float]:
    """This micro-batch's share of the ROLLOUT_METRICS (token sums over the mini-batch's global count)."""
    diff = (logp.double() - rollout.double()) * mask  # [B, T-1]; fp64: exp(d) - d - 1 of a tiny d
    out = {
        "rollout/logprob_abs_diff": diff.abs().sum().item() / global_tokens,
        "rollout/kl": ((diff.exp() - diff - 1) * mask).sum().item() / global_tokens,
    }
    if raw_weights is not None:
        capped = raw_weights.clamp(max=plan.rollout_is_cap)
        out["rollout/is_weight_mean"] = (capped * mask).sum().item() / global_tokens
        out["rollout/is_capped_frac"] = (
            (raw_weights > plan.rollout_is_cap) * mask
        ).sum().item() / global_tokens
    return out


def whiten_rows(
    advantages: list[torch.Tensor], group: dist.ProcessGroup | None = None, weights: list[float] | None = None
) -> list[torch.Tensor]:
    """Whiten per-token advantages [len_i] of rows over every token of the step, all-reduced over `group`.

    REINFORCE++ normalises over the whole batch; the dp ranks each hold a share, so they sum their moments.
    Rows of weight 0 (left out of the update) do not count in the moments.
    """
    flat = torch.cat([a.float() for a in advantages]) if advantages else torch.zeros(0)  # [sum len_i]
    valid = torch.ones_like(flat, dtype=torch.bool)
    if weights is not None:
        valid = torch.cat([torch.full((len(a),), w > 0) for a, w in zip(advantages, weights)] or [valid])
    moments = all_reduce_sum(masked_moments(flat, valid), group)
    return list(whiten(flat, valid, moments=moments).split([len(a) for a in advantages]))
