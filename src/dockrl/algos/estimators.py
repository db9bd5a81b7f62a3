"""Advantage estimators per algorithm, DAPO's overlong reward shaping, GAE and advantage whitening.

Shape letters: N rows (= G groups x S samples per prompt), G groups, S group size, B rows, T tokens.

Rows of one prompt are contiguous: rows [g*S, (g+1)*S) form group g, as the dock serves whole groups.

The group estimators map one scalar reward per row to one scalar advantage per row; the trainer
broadcasts it over the row's response tokens. `compute_advantages` picks one by name:

    grpo, dapo, gspo   (r - group mean) / (group std + eps)
    dr_grpo            r - group mean (no std: Dr. GRPO removes the difficulty bias)
    rloo               r - mean of the other S-1 rewards of the group = S/(S-1) * (r - group mean)
    reinforce_pp       r itself; whitened later over every valid token of the step (`whiten`)
    reinforce_pp_baseline
                       r - group mean; whitened later over every valid token of the step
    gae                needs a critic (token values); see `gae_advantages`
    none               0 (opd: the teacher's per-token term, algos/distill.py, is the whole advantage)

Whitening over the whole step needs every row, so it cannot run where groups are scored one pull at a
time; `needs_batch_whitening` tells the trainer to do it over its rows (all-reduced over dp ranks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dockrl.algos.advantages import group_normalized_advantages

# The estimator names and each algorithm's own estimator are declared once, in the preset table.
from dockrl.config.presets import ADV_ESTIMATORS, DEFAULT_ESTIMATOR, GROUP_ESTIMATORS, WHITENED_ESTIMATORS

__all__ = [
    "ADV_ESTIMATORS",
    "DEFAULT_ESTIMATOR",
    "GROUP_ESTIMATORS",
    "compute_advantages",
    "gae_advantages",
    "group_mean_advantages",
    "kl_shaped_returns",
    "masked_moments",
    "needs_batch_whitening",
    "overlong_penalty",
    "rloo_advantages",
    "whiten",
]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Check and view [N] rewards as [G, S] fp32."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} rows; "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.float().view(-1, group_size)  # [G, S]


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the other rewards of its group ([N] -> [N] fp32).

    Groups of one have no other sample and get zeros.
    """
    grouped = _grouped(rewards, group_size)  # [G, S]
    if group_size == 1:
        return torch.zeros(rewards.numel(), dtype=torch.float32)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [G, S]
    return (grouped - others_mean).reshape(-1)


def group_mean_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Reward minus its group's mean ([N] -> [N] fp32); the REINFORCE++ baseline and Dr. GRPO."""
    grouped = _grouped(rewards, group_size)  # [G, S]
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def compute_advantages(
    name: str, rewards: Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """Per-row advantages [N] fp32 from per-row rewards [N] with estimator `name` (`GROUP_ESTIMATORS`).

    The REINFORCE++ estimators return the (baselined) rewards; the trainer whitens them over the step.
    `eps` and `normalize_std` apply to the grpo estimator only.
    """
    if name == "grpo":
        return group_normalized_advantages(rewards, group_size, eps=eps, normalize_std=normalize_std)
    if name in ("dr_grpo", "reinforce_pp_baseline"):
        return group_mean_advantages(rewards, group_size)
    if name == "rloo":
        return rloo_advantages(rewards, group_size)
    if name == "reinforce_pp":
        _grouped(rewards, group_size)
        return rewards.float().clone()
    if name == "none":
        return torch.zeros(_grouped(rewards, group_size).numel(), dtype=torch.float32)
    if name == "gae":
        raise ValueError("the gae estimator needs critic values per token; call gae_advantages")
    raise ValueError(f"unknown advantage estimator {name!r}; choose one of {ADV_ESTIMATORS}")


def needs_batch_whitening(name: str) -> bool:
    """Whether estimator `name` whitens its advantages over all valid tokens of the step."""
    return name in WHITENED_ESTIMATORS


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward ([N] lengths -> [N] fp32, <= 0).

        0                                        length <= max_len - buffer_len
        (max_len - buffer_len - length) / buffer_len * penalty   inside the buffer (linear to -penalty)
        -penalty                                 length > max_len

    `max_len` is rollout.max_new_tokens, so a truncated response (length == max_len) gets -penalty.
    """
    if buffer_len < 1 or buffer_len > max_len:
        raise ValueError(f"buffer_len must be in [1, max_len={max_len}]; got {buffer_len}")
    start = max_len - buffer_len
    over = (lengths.float() - start).clamp(min=0)  # [N]
    return -(over / buffer_len).clamp(max=1.0) * penalty


def kl_shaped_returns(advantages: Tensor, kl: Tensor, kl_coef: float) -> Tensor:
    """REINFORCE++ with the KL in the reward: token rewards -kl_coef * kl_t plus the row's (baselined) reward
    at its last token, summed to go (gamma = 1): A_t = A - kl_coef * sum_{t' >= t} kl_t'. One row, [R] in/out."""
    to_go = kl.flip(-1).cumsum(-1).flip(-1)  # [R]
    return advantages - kl_coef * to_go


def masked_moments(values: Tensor, mask: Tensor) -> Tensor:
    """[sum, sum of squares, count] (fp64) of `values` where `mask` is set; sum these over ranks."""
    mask_d = mask.to(torch.float64)
    v = values.to(torch.float64) * mask_d
    return torch.stack([v.sum(), (v * values.to(torch.float64)).sum(), mask_d.sum()])


def whiten(values: Tensor, mask: Tensor, *, moments: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """(values - mean) / (std + eps) over the tokens where `mask` is set; masked tokens become 0.

    The std is the population std (no Bessel correction). Pass `moments` (from `masked_moments`,
    summed over data-parallel ranks) to whiten with global statistics.
    """
    total, total_sq, count = (masked_moments(values, mask) if moments is None else moments).tolist()
    count = max(count, 1.0)
    mean = total / count
    std = max(total_sq / count - mean * mean, 0.0) ** 0.5
    return ((values.float() - mean) / (std + eps)) * mask.to(torch.float32)


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation on per-token rewards with right-padded rows.

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, with V and A past
    the last valid token of a row taken as 0 (the episode ends there).

    Args:
        token_rewards: [B, T] reward per token (the sequence reward usually sits on the last valid token).
        values: [B, T] critic values.
        mask: [B, T] 1 on valid tokens; each row's valid tokens are a prefix.

    Returns:
        (advantages [B, T], returns [B, T] = advantages + values), both 0 on masked tokens.
    """
    mask_f = mask.float()
    rewards_m, values_m = token_rewards.float() * mask_f, values.float() * mask_f
    num_tokens = rewards_m.shape[1]
    next_value = torch.zeros_like(rewards_m[:, 0])  # [B]
    next_adv = torch.zeros_like(rewards_m[:, 0])  # [B]
    advantages = torch.zeros_like(rewards_m)  # [B, T]
    for t in reversed(range(num_tokens)):
        delta = rewards_m[:, t] + gamma * next_value - values_m[:, t]
        adv_t = (delta + gamma * lam * next_adv) * mask_f[:, t]
        advantages[:, t] = adv_t
        # A padded position resets the recursion: the next valid token (further left) sees V=0, A=0.
        next_value, next_adv = values_m[:, t], adv_t
    return advantages, (advantages + values_m) * mask_f
