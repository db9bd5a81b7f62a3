"""Reward functions (verifiers) and the process-pool runner that applies them (pure python, no torch)."""

from dockrl.rewards.base import RewardFn, RewardResult, resolve_reward_fn
from dockrl.rewards.builtin import BUILTIN_REWARDS, exact_answer, format_reward, math_verify_reward
from dockrl.rewards.runner import RewardRunner, RewardSpec

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "RewardSpec",
    "exact_answer",
    "format_reward",
    "math_verify_reward",
    "resolve_reward_fn",
]
