"""Loss terms: the clipped policy surrogate, KL penalty estimators, entropy bonus, aggregation, and PPO's
clipped value loss (the critic's).

Shape letters: B rows (sequences) in the micro-batch, T response tokens per row (padded).

Every per-token term is [B, T] and is reduced by ``aggregate`` with the same mode and normaliser, so
the loss is one linear reduction of ``pg + kl_coef * kl - entropy_coef * entropy`` (+ ``distill_coef`` x
top-k distillation's forward KL). ``mask`` marks the tokens that count (response tokens, not padding, not
tool output); it may be bool or float.

Micro-batching: with ``agg="token-mean"`` pass ``num_tokens`` = valid tokens of the whole optimizer
step (summed over micro-batches and data-parallel ranks). Each micro-batch loss is then its share of
the global mean, and the accumulated gradient equals one pass over the full batch.

`policy_loss` reads how to form the loss from a `LossPlan` (algos/registry.py), the trainer passes it whole: a new
loss knob is a setting (config/training_schema.py), a LossPlan field, its line in config/step_plan.py `loss_plan`
and its use here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dockrl.algos.registry import KL_ESTIMATORS, LOSS_AGGS, LossPlan

AGG_MODES = LOSS_AGGS  # the closed choices of algo.loss_agg

# What `policy_loss` computes without a plan: PPO's clipped surrogate (0.2 both ways), token-mean, no KL and
# no entropy term.
PPO_CLIP_LOSS = LossPlan(
    agg="token-mean",
    clip_low=0.2,
    clip_high=0.2,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy_coef=0.0,
    sequence_ratio=False,
    seq_len_norm=None,
)

# exp() of a log-ratio beyond +-20 overflows or underflows to useless values; verl and MindSpeed clamp
# the log-ratio at 20 and the k3 result at 10 ("low_var_kl").
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of the sampled tokens.

    Estimators (Schulman, "Approximating KL divergence"), with d = logp - ref:
        k1 = d                                  unbiased, high variance, can be negative
        k2 = 0.5 * d**2                         biased, low variance, >= 0
        k3 = exp(-d) - (-d) - 1                 unbiased, low variance, >= 0; -d clamped to [-20, 20]
                                                and the result to [-10, 10] (verl/MindSpeed low_var_kl)

    Args:
        logprobs: [B, T] current policy log-probs.
        ref_logprobs: [B, T] reference policy log-probs.
        estimator: one of ``KL_ESTIMATORS``.

    Returns:
        [B, T] per-token KL estimate (differentiable w.r.t. ``logprobs``).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if estimator == "k3":
        log_ratio = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
        return (log_ratio.exp() - log_ratio - 1).clamp(-_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    seq_len_norm: float | None = None,
) -> Tensor:
    """Reduce a per-token [B, T] term to a scalar over the tokens where ``mask`` is set.

    Modes:
        "token-mean":          sum(values * mask) / mask.sum(); every token weighs the same
                               (DAPO). ``num_tokens`` replaces mask.sum() with a global count.
        "seq-mean-token-mean": mean over rows of each row's mean over its valid tokens (GRPO paper).
        "seq-mean-token-sum":  mean over rows of each row's sum over its valid tokens (Dr. GRPO).
    In the two seq modes ``num_seqs`` replaces the row count B with a global row count. Each count
    is ignored by the modes it does not apply to, so a trainer can always pass both. Rows or batches
    with no valid token contribute 0 (never NaN). ``seq_len_norm`` divides each row's token sum in
    "seq-mean-token-sum" by a constant (Dr. GRPO uses the generation limit, so every token of every row
    weighs the same whatever the lengths); other modes ignore it.

    Args:
        values: [B, T] per-token values.
        mask: [B, T] bool or float, 1 where the token counts.
        mode: one of ``AGG_MODES``.
        num_tokens: global valid-token count for "token-mean" across micro-batches.
        num_seqs: global row count for the seq modes across micro-batches.
        seq_len_norm: constant divisor of each row's token sum in "seq-mean-token-sum".

    Returns:
        Scalar tensor.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")
    mask_f = mask.to(values.dtype)  # [B, T]
    masked = values * mask_f  # [B, T]
    if mode == "token-mean":
        denom = mask_f.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=values.dtype)
        return masked.sum() / denom.clamp(min=1)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        per_seq = masked.sum(dim=-1)  # [B]
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / mask_f.sum(dim=-1).clamp(min=1)  # [B]
        elif seq_len_norm is not None:
            per_seq = per_seq / seq_len_norm  # [B]
        num_rows = per_seq.numel() if num_seqs is None else num_seqs
        return per_seq.sum() / max(num_rows, 1)
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {AGG_MODES}")


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over the tokens where ``mask`` is set (0 when none is)."""
    mask_f = mask.to(values.dtype)
    return (values * mask_f).sum() / mask_f.sum().clamp(min=1)


@dataclass
class PolicyLossOutput:
    """Result of ``policy_loss``: the loss to backpropagate and detached scalars to log.

    Attributes:
        loss: scalar with grad, pg_loss + kl_coef * kl - entropy_coef * entropy + distill_coef * distill_kl
            (only terms in use).
        pg_loss: aggregated clipped surrogate.
        kl: aggregated KL penalty vs the reference (0 when no ref_logprobs are given), logged even
            when kl_coef is 0.
        entropy: aggregated entropy (0 when no entropy is given).
        clip_frac: fraction of valid tokens where the clipped branch of the surrogate is active;
            clip_frac_high + clip_frac_low: at the upper bound (A > 0, ratio > 1 + clip_high: DAPO's
            clip-higher acts there) and at the lower one (A < 0, ratio < 1 - clip_low).
        approx_kl: mean over valid tokens of (old_logprobs - logprobs), the k1 estimate of
            KL(old || current) under samples from old; same definition as verl/MindSpeed ``ppo_kl``.
    """

    loss: Tensor
    pg_loss: Tensor
    kl: Tensor
    entropy: Tensor
    clip_frac: Tensor
    approx_kl: Tensor
    clip_frac_high: Tensor
    clip_frac_low: Tensor


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    plan: LossPlan = PPO_CLIP_LOSS,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    is_weights: Tensor | None = None,
    distill_kl: Tensor | None = None,
    **settings: Any,
) -> PolicyLossOutput:
    """PPO/GRPO clipped policy loss with optional KL-to-reference penalty and entropy bonus, formed as `plan`
    says (the run's StepPlan.loss). Keywords named like plan fields (``clip_low=0.1``, ``agg=...``,
    ``sequence_ratio=True``) replace them for this call; without a plan, ``PPO_CLIP_LOSS``.

    Per token, with ratio = exp(logprobs - old_logprobs) (log-ratio clamped to [-20, 20]):
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    ``clip_low != clip_high`` gives DAPO's clip-higher. ``sequence_ratio=True`` is GSPO: every token of
    a row uses the row's ratio exp(mean over its valid tokens of the log-ratio), clipped per sequence;
    its gradient reaches each token's log-prob with weight 1 / (valid tokens of the row). The loss adds
    ``kl_coef * kl_penalty`` when ``kl_coef > 0`` and subtracts ``entropy_coef * entropy`` when
    ``entropy_coef > 0``. Every term is reduced by ``aggregate`` with ``plan.agg``, ``plan.seq_len_norm``
    and the global counts.

    Args:
        logprobs: [B, T] current policy log-probs (with grad).
        old_logprobs: [B, T] log-probs of the policy that sampled the tokens (no grad).
        advantages: [B, T] per-token advantages, or [B] per-row (broadcast over tokens).
        mask: [B, T] bool/float, 1 on tokens that count.
        plan: clip range, KL weight and estimator (``KL_ESTIMATORS``), entropy weight, aggregation, ratio level.
        ref_logprobs: [B, T] reference log-probs; required when kl_coef > 0.
        entropy: [B, T] per-token entropy (with grad); required when entropy_coef > 0.
        num_tokens, num_seqs: global counts of the optimizer step, see ``aggregate``.
        is_weights: [B, T] importance weights of the rollout-vs-trainer correction (truncated importance
            sampling: min(exp(old - rollout), cap), no grad), multiplied into each token's surrogate.
        distill_kl: [B, T] top-k distillation's per-token forward KL to the teacher (algos/distill.py, with
            grad); the loss adds ``plan.distill_coef`` x its aggregate.
    """
    plan = _with_settings(plan, settings)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    _check_inputs(logprobs, old_logprobs, advantages, mask, plan, ref_logprobs, entropy)

    def reduce(values: Tensor) -> Tensor:
        return aggregate(
            values, mask, plan.agg, num_tokens=num_tokens, num_seqs=num_seqs, seq_len_norm=plan.seq_len_norm
        )

    log_ratio = _log_ratio(logprobs, old_logprobs, mask, plan.sequence_ratio)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - plan.clip_low, 1.0 + plan.clip_high)  # [B, T]
    surrogate = torch.maximum(unclipped, clipped)  # [B, T]
    pg_loss = reduce(surrogate if is_weights is None else surrogate * is_weights)
    loss = pg_loss

    zero = pg_loss.new_zeros(())
    kl = zero
    if ref_logprobs is not None:
        kl = reduce(kl_penalty(logprobs, ref_logprobs, plan.kl_estimator))
        if plan.kl_coef > 0:
            loss = loss + plan.kl_coef * kl
    distill = zero
    if distill_kl is not None:
        distill = reduce(distill_kl)
        if plan.distill_coef > 0:
            loss = loss + plan.distill_coef * distill
    entropy_agg = zero
    if entropy is not None:
        entropy_agg = reduce(entropy)
        if plan.entropy_coef > 0:
            loss = loss - plan.entropy_coef * entropy_agg

    with torch.no_grad():
        active = clipped > unclipped  # [B, T]
        clip_frac = masked_mean(active.to(logprobs.dtype), mask)
        clip_frac_high = masked_mean((active & (advantages > 0)).to(logprobs.dtype), mask)
        clip_frac_low = masked_mean((active & (advantages < 0)).to(logprobs.dtype), mask)
        approx_kl = masked_mean(-log_ratio, mask)
    return PolicyLossOutput(
        loss=loss,
        pg_loss=pg_loss.detach(),
        kl=kl.detach(),
        entropy=entropy_agg.detach(),
        clip_frac=clip_frac,
        approx_kl=approx_kl,
        clip_frac_high=clip_frac_high,
        clip_frac_low=clip_frac_low,
    )


def _with_settings(plan: LossPlan, settings: dict[str, Any]) -> LossPlan:
    """`plan` with the fields named in `settings` replaced (policy_loss's keyword form)."""
    if not settings:
        return plan
    unknown = sorted(settings.keys() - {f.name for f in dataclasses.fields(LossPlan)})
    if unknown:
        raise TypeError(
            f"policy_loss() got {unknown}, which are no LossPlan fields; use one of "
            f"{[f.name for f in dataclasses.fields(LossPlan)]}"
        )
    return dataclasses.replace(plan, **settings)


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    plan: LossPlan,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
) -> None:
    """Shapes agree with `logprobs` [B, T], and the KL and entropy terms in use have their inputs."""
    for name, tensor in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if plan.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={plan.kl_coef} needs ref_logprobs; pass them or set kl_coef=0")
    if plan.entropy_coef > 0 and entropy is None:
        raise ValueError(
            f"entropy_coef={plan.entropy_coef} needs per-token entropy; pass it or set entropy_coef=0"
        )


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, sequence_ratio: bool) -> Tensor:
    """log(pi / pi_old) [B, T], clamped; with `sequence_ratio` (GSPO) each row's mean over its valid tokens."""
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    if not sequence_ratio:
        return log_ratio
    mask_f = mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)  # [B]
    return seq_log_ratio.unsqueeze(-1).expand_as(logprobs)  # [B, T]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> Tensor:
    """PPO clipped value loss: 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), aggregated.

    `clip=None` gives the plain squared error. All tensors are [B, T].
    """
    err, clipped_err = _value_errors(values, old_values, returns, clip)
    if clipped_err is not None:
        err = torch.maximum(err, clipped_err)
    return aggregate(0.5 * err, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)


def value_clip_frac(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float
) -> Tensor:
    """Share of valid tokens where `value_loss` takes the clipped branch (its error is the larger); [B, T] in."""
    err, clipped_err = _value_errors(values.detach(), old_values, returns, clip)
    assert clipped_err is not None  # a float clip always gives the clipped errors
    return masked_mean((clipped_err > err).float(), mask)


def _value_errors(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None
) -> tuple[Tensor, Tensor | None]:
    """Squared errors [B, T] of the values and (with `clip`) of the values clipped to V_old +- clip."""
    err = (values - returns).square()  # [B, T]
    if clip is None:
        return err, None
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # [B, T]
    return err, (clipped - returns).square()
