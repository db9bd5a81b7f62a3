"""Token-level advantage math of the trainer and the critic: REINFORCE++'s KL-shaped returns, whitening over
every valid token of the step, and PPO's generalised advantage estimation.

Shape letters: B rows, T tokens (right-padded; each row's valid tokens are a prefix), R tokens of one row.

The reward stage's group estimators (one scalar advantage per row) are in estimators.py; an estimator's
`whitened` trait (algos/registry.py) says the trainer whitens its advantages here, over all its rows.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
