"""Advantage estimators that need no critic.

Shape letters: N rows (= G groups x S samples per prompt), G groups, S group size.

Rows of one prompt are contiguous: rows [g*S, (g+1)*S) form group g, as the dock serves whole groups.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_normalized_advantages(
    rewards: Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """GRPO advantage: each reward minus its group's mean, divided by the group's std (+ eps).

    The std is the unbiased sample std (``torch.std`` default, Bessel's correction), as in GRPO's
    reference implementations (MindSpeed RL, verl). A group whose rewards are all equal gets zero
    advantages (its deviations are exactly 0), and ``group_size == 1`` gives zeros (no baseline exists).

    Args:
        rewards: [N] scalar reward per row, N = G * group_size, groups contiguous.
        group_size: S, samples per prompt.
        eps: added to the std so near-constant groups do not blow up.
        normalize_std: False gives ``r - mean`` only (Dr. GRPO style).

    Returns:
        [N] fp32 advantages.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} rows, not a multiple of group_size={group_size}; "
            "the dock must hand over whole groups"
        )
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    grouped = rewards.float().view(-1, group_size)  # [G, S]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [G, S]
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # [G, S]
    return centered.reshape(-1)  # [N]
