"""PPO pieces around the critic: token rewards, the KL controller and the critic's diagnostics.

Shape letters: B rows, T response tokens per row (right-padded; each row's valid tokens are a prefix).

PPO's data flow per row (the CriticWorker runs it; `gae_advantages` lives in advantages.py, `value_loss` in
losses.py):

    sequence reward r, per-token KL k_t (optional) ─▶ token rewards: -kl_coef * k_t, plus r on the last token
    token rewards, critic values V_t ─▶ GAE (gamma, lambda) ─▶ advantages A_t, returns A_t + V_t
    advantages ─▶ whitened over every valid token of the step (the actor's update, `whiten`)
    returns, values ─▶ clipped value loss (critic update); explained variance of the values

The KL coefficient is fixed, or adapted once per step by the controller of Ziegler et al. 2019 ("Fine-Tuning
Language Models from Human Preferences"), as in verl and OpenRLHF:

    error = clip(current_kl / target - 1, -0.2, 0.2) ;  kl_coef <- kl_coef * (1 + error * rows / horizon)
"""

from __future__ import annotations

import torch
from torch import Tensor

from dockrl.algos.advantages import masked_moments
from dockrl.algos.registry import KL_CONTROLLERS

# verl's explained-variance denominator guard: finite even when every return is the same.
_EXPLAINED_VARIANCE_EPS = 1e-5


def pad_rows(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Ragged rows [len_i] -> right-padded fp32 [B, T] (T = longest row) and its prefix mask [B, T] (bool)."""
    num_tokens = max((len(r) for r in rows), default=0)
    padded = torch.zeros(len(rows), num_tokens)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row.float()
    lengths = torch.tensor([len(r) for r in rows])
    return padded, torch.arange(num_tokens)[None, :] < lengths[:, None]


def token_level_rewards(
    scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards [B, T]: -kl_coef * kl on every valid token, plus the sequence score on the last one.

    Args:
        scores: [B] sequence rewards (what the reward functions return).
        mask: [B, T] prefix mask of valid response tokens.
        kl: [B, T] per-token KL estimate of the sampling policy to the reference, or None (no KL term).
        kl_coef: weight of the KL penalty.
    """
    mask_f = mask.float()
    rewards = torch.zeros_like(mask_f)  # [B, T]
    if kl is not None:
        rewards = -kl_coef * kl.float() * mask_f
    lengths = mask_f.sum(-1).long()  # [B]
    has_tokens = lengths > 0  # a row without a token has nowhere to put its score
    last = (lengths - 1).clamp(min=0)[:, None]  # [B, 1]
    return rewards.scatter_add(1, last, (scores.float() * has_tokens)[:, None])


def explained_variance_moments(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """The six sums `explained_variance` needs (fp64); sum them over data-parallel ranks for a global figure."""
    return torch.cat([masked_moments(returns - values, mask), masked_moments(returns, mask)])


def explained_variance(moments: Tensor) -> float:
    """1 - Var[returns - values] / (Var[returns] + 1e-5) over the valid tokens the moments cover.

    1 means the critic predicts every return, 0 that it does no better than a constant, below 0 worse.
    Takes `explained_variance_moments` (summed over ranks); population variances.
    """

    def variance(total: float, total_sq: float, count: float) -> float:
        count = max(count, 1.0)
        return max(total_sq / count - (total / count) ** 2, 0.0)

    err, ret = moments.tolist()[:3], moments.tolist()[3:]
    return 1.0 - variance(*err) / (variance(*ret) + _EXPLAINED_VARIANCE_EPS)


class KLController:
    """The coefficient of the KL penalty in the reward; `update` once per step with the step's measured KL.

    kind "fixed" keeps `value`; "adaptive" moves it towards the KL `target` over `horizon` rows (module docstring).
    """

    def __init__(self, kind: str, value: float, *, target: float = 0.1, horizon: int = 10000):
        if kind not in KL_CONTROLLERS:
            raise ValueError(f"unknown KL controller {kind!r}; choose one of {KL_CONTROLLERS}")
        if kind == "adaptive" and (target <= 0 or horizon < 1):
            raise ValueError(
                f"the adaptive controller needs target > 0 and horizon >= 1; got {target}, {horizon}"
            )
        self.kind, self.value, self.target, self.horizon = kind, value, target, horizon

    def update(self, current_kl: float, num_rows: int) -> float:
        """Adapt the coefficient after a step whose mean per-token KL was `current_kl`; returns the new value."""
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * num_rows / self.horizon
        return self.value
