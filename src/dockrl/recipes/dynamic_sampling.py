"""DAPO dynamic sampling: keep generating until the step's batch is full of groups that carry a signal.

A group whose samples are all correct or all wrong teaches nothing about correctness. As in DAPO, a group is
informative when some but not all of its answers are correct: the filter reads the rule reward's `<fn>/correct`
component when a reward function reports one, else the rule reward itself, both before reward-model and
overlong shaping (a length penalty spreads the rewards of an all-wrong group without making it informative).
A group left out of the update for a failed reward call (update weight 0) is never informative.
With `algo.dynamic_sampling`, the driver runs rollout rounds:

    round 1: the step's prompts_per_step prompts  ─▶ generate + score (overlapped, through the dock)
    round r: as many new prompts as informative groups are still missing ─▶ generate + score
    stop when prompts_per_step informative groups exist, or after algo.max_sampling_rounds rounds

then keeps the first prompts_per_step informative groups (in row order) and drops every other group from
the dock (`client.drop`), so the log-prob and update stages see a batch of the usual size. If the rounds run
out first, zero-spread groups fill the batch (they add KL and entropy terms but no policy gradient), so the
batch shape, and with it the actors' mini-batching, never changes. `dapo/rounds` says how many rounds ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Selection:
    """Which groups (by first row id) a step trains on and which it drops."""

    keep: list[int] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)
    informative: int = 0  # kept groups with reward spread
    filled: int = 0  # kept zero-spread groups (the rounds ran out)


def has_spread(rewards: list[float], tol: float = 1e-6) -> bool:
    """True if the group's rewards are not all equal (its advantages are not all zero)."""
    return max(rewards) - min(rewards) > tol


def select_groups(groups: dict[int, list[float]], target: int, *, fill: bool) -> Selection:
    """The first `target` informative groups in row order; with `fill`, zero-spread groups complete a short
    batch. groups: first row id -> the rewards of the group's rows."""
    ordered = sorted(groups)
    informative = [g for g in ordered if has_spread(groups[g])]
    keep = informative[:target]
    filled = 0
    if fill and len(keep) < target:
        flat = [g for g in ordered if not has_spread(groups[g])][: target - len(keep)]
        keep, filled = sorted(keep + flat), len(flat)
    kept = set(keep)
    return Selection(
        keep=keep, drop=[g for g in ordered if g not in kept], informative=len(keep) - filled, filled=filled
    )


def group_rewards(
    rows: list[int], rewards: list[float], group_size: int, weights: list[float] | None = None
) -> dict[int, list[float]]:
    """first row id -> the filter values of its rows, from the (row, value) pairs the reward workers report
    (ScoreResult.accuracy). `weights`: each row's update weight; a group with a weight-0 row is left out of the
    update, so its values read as zeros (no spread: never informative, only a filler)."""
    groups: dict[int, list[tuple[int, float]]] = {}  # first row id -> its (row, value) pairs
    dropped: set[int] = set()
    for i, (row, reward) in enumerate(zip(rows, rewards)):
        first = row - row % group_size
        groups.setdefault(first, []).append((row, reward))
        if weights is not None and weights[i] == 0.0:
            dropped.add(first)
    return {
        first: [0.0 if first in dropped else r for _, r in sorted(pairs)]
        for first, pairs in sorted(groups.items())
    }
