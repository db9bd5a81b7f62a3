"""Advantage estimators, one decorated function each, and DAPO's overlong reward shaping.

Shape letters: N rows (= G groups x S samples per prompt), G groups, S group size.

Rows of one prompt are contiguous: rows [g*S, (g+1)*S) form group g, as the dock serves whole groups.

A group estimator maps one scalar reward per row to one scalar advantage per row; the trainer broadcasts it
over the row's response tokens. Each registers by name with its traits (algos/registry.py), and
`compute_advantages` looks it up:

    grpo, dapo, gspo   (r - group mean) / (group std + eps)
    dr_grpo            r - group mean (no std: Dr. GRPO removes the difficulty bias)
    rloo               r - mean of the other S-1 rewards of the group = S/(S-1) * (r - group mean)
    reinforce_pp       r itself; whitened later over every valid token of the step (algos/advantages.py)
    reinforce_pp_baseline
                       r - group mean; whitened later over every valid token of the step
    gae                needs a critic (token values); the critic runs algos/advantages.py `gae_advantages`
    none               0 (opd: the teacher's per-token term, algos/distill.py, is the whole advantage)

Whitening over the whole step needs every row, so it cannot run where groups are scored one pull at a
time; the `whitened` trait tells the trainer to do it over its rows (all-reduced over dp ranks).

A new estimator is one more decorated function here; its traits, not its name, decide where it runs and what
config allows with it (docs/algorithms.md, "Adding an estimator"):

    @estimator("my_estimator", group_baseline=True)
    def my_estimator(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
        grouped = _grouped(rewards, group_size)  # [G, S]
        ...

This module imports no torch, only its types: config/ reads what registers here before any worker starts, and
the driver's start-up does not pay for torch. The functions call the methods of the tensors they are given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dockrl.algos.registry import AdvantageSettings, estimator, estimator_named

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "compute_advantages",
    "group_mean_advantages",
    "group_normalized_advantages",
    "needs_batch_whitening",
    "overlong_penalty",
    "rloo_advantages",
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
        return rewards.float().new_zeros(rewards.shape)  # [N]
    grouped = rewards.float().view(-1, group_size)  # [G, S]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [G, S]
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # [G, S]
    return centered.reshape(-1)  # [N]


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the other rewards of its group ([N] -> [N] fp32).

    Groups of one have no other sample and get zeros.
    """
    grouped = _grouped(rewards, group_size)  # [G, S]
    if group_size == 1:
        return grouped.new_zeros(rewards.numel())  # [N]
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [G, S]
    return (grouped - others_mean).reshape(-1)


def group_mean_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Reward minus its group's mean ([N] -> [N] fp32); the REINFORCE++ baseline and Dr. GRPO."""
    grouped = _grouped(rewards, group_size)  # [G, S]
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


# ---------------------------------------------------------------- the registered estimators


@estimator("grpo", group_baseline=True, std_normalized=True)
def grpo(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
    """GRPO (also dapo's and gspo's): `group_normalized_advantages` with algo.adv_eps, algo.norm_adv_by_std."""
    return group_normalized_advantages(
        rewards, group_size, eps=settings.eps, normalize_std=settings.normalize_std
    )


@estimator("dr_grpo", group_baseline=True)
def dr_grpo(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
    """Dr. GRPO: the group-centred reward, no std."""
    return group_mean_advantages(rewards, group_size)


@estimator("rloo", group_baseline=True)
def rloo(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
    """RLOO: the leave-one-out baseline."""
    return rloo_advantages(rewards, group_size)


@estimator("reinforce_pp", whitened=True, kl_in_reward=True)
def reinforce_pp(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
    """REINFORCE++: the reward itself, whitened over the step by the trainer."""
    _grouped(rewards, group_size)
    return rewards.float().clone()


@estimator("reinforce_pp_baseline", group_baseline=True, whitened=True, kl_in_reward=True)
def reinforce_pp_baseline(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
    """REINFORCE++ with the group-mean baseline, whitened over the step by the trainer."""
    return group_mean_advantages(rewards, group_size)


@estimator("none", needs_teacher=True)
def no_advantage(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
    """opd's: zero for every row (the teacher's per-token term is the whole advantage)."""
    grouped = _grouped(rewards, group_size)  # [G, S]
    return grouped.new_zeros(grouped.numel())  # [N]


@estimator("gae", needs_critic=True, whitened=True, kl_in_reward=True)
def gae(rewards: Tensor, group_size: int, settings: AdvantageSettings) -> Tensor:
    """PPO's GAE needs a critic's token values: the CriticWorker runs algos/advantages.py `gae_advantages`."""
    raise ValueError("the gae estimator needs critic values per token; call gae_advantages")


# ---------------------------------------------------------------- lookups and shaping


def compute_advantages(
    name: str, rewards: Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """Per-row advantages [N] fp32 from per-row rewards [N] with the registered estimator `name`.

    The REINFORCE++ estimators return the (baselined) rewards; the trainer whitens them over the step.
    `eps` and `normalize_std` apply to the grpo estimator only.
    """
    return estimator_named(name).fn(rewards, group_size, AdvantageSettings(eps, normalize_std))


def needs_batch_whitening(name: str) -> bool:
    """Whether estimator `name` whitens its advantages over all valid tokens of the step."""
    return estimator_named(name).whitened


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


# The token-level functions moved to algos/advantages.py (they need torch at import); older imports of them from
# this module load that one on first access.
_IN_ADVANTAGES = ("gae_advantages", "kl_shaped_returns", "masked_moments", "whiten")


def __getattr__(name: str) -> Any:
    if name in _IN_ADVANTAGES:
        import dockrl.algos.advantages as advantages

        return getattr(advantages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
