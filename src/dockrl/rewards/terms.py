"""The reward stage's terms: one per feature, each reading its own dock columns and adding its part to the rows'
reward or advantages. The RewardWorker builds its list once from the run's settings and applies it, in order,
to every pull of whole groups (`ScoredGroups`):

    term              when                               reads                           does
    RuleRewards       reward.functions                   label (and the decoded text)    scores = weighted rule rewards
    EnvReward         env.name (multi-turn)              env_reward, env_failed          + env.reward_weight x reward
    Accuracy          always                             -                               what dynamic sampling filters on
    ModelScore        reward.model.path                  rm_score                        + reward.model.weight x score
    OverlongPenalty   algo.overlong_buffer_len > 0       response_ids                    + DAPO's penalty (<= 0)
    DropFailedGroups  reward.on_error=drop_group         -                               update weight 0 per failed group
    GroupAdvantages   a group estimator (not ppo's gae)  response_ids                    advantages of the totals, per token
    TeacherTerm       distill.teacher_path               teacher_logprobs, rollout_...   + distill.coef x (teacher - rollout)

The order is the arithmetic: the score terms add up the total reward before `GroupAdvantages` turns it into
advantages, and `Accuracy` reads the task's own reward before reward-model and overlong shaping. A new reward-side
feature is one term here and one line where the worker builds its list (workers/reward.py `reward_terms`).

Shape letters: N rows of a pull (whole groups of S), R response tokens of a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dockrl.algos.distill import distill_advantages
from dockrl.algos.estimators import overlong_penalty
from dockrl.algos.registry import AdvantageSettings, estimator_named
from dockrl.dock.columns import (
    ADVANTAGES,
    ENV_FAILED,
    ENV_REWARD,
    LABEL,
    LOSS_MASK,
    RESPONSE_IDS,
    REWARD,
    RM_SCORE,
    ROLLOUT_LOGPROBS,
    TEACHER_LOGPROBS,
    UPDATE_WEIGHT,
    reward_component,
)
from dockrl.rewards.runner import RewardRunner, accuracy_key

# The components the terms add (dock columns reward/<component>), beside each rule function's own.
ENV, RM, OVERLONG = "env", "rm", "overlong"


@dataclass
class ScoredGroups:
    """The whole groups of one pull as the terms score them; lives for one pull of `RewardWorker.score`."""

    batch: dict[str, list]  # the pulled columns by name: N rows each
    prompts: list[str]  # decoded
    responses: list[str]  # decoded (multi-turn: the final answer, the trajectory's last policy turn)
    group_size: int  # S: rows [g*S, (g+1)*S) of the pull form a group
    scores: list[float] = field(init=False)  # each row's total reward so far, 0 before any term
    components: dict[str, list[float]] = field(default_factory=dict)  # reward/<component> columns
    failed: list[int] = field(default_factory=list)  # rows whose reward call or environment failed
    timeouts: int = 0
    errors: int = 0
    correct: list[float] = field(default_factory=list)  # <fn>/correct per row, when a function reports it
    accuracy: list[float] = field(default_factory=list)  # what dynamic sampling filters on, per row
    weights: list[float] = field(init=False)  # update_weight per row (0: the row's group is left out)
    advantages: list[torch.Tensor] | None = None  # per row [R], once an estimator ran

    def __post_init__(self) -> None:
        self.scores = [0.0] * len(self.prompts)
        self.weights = [1.0] * len(self.prompts)

    def columns_out(self) -> dict[str, list]:
        """What the reward stage puts: reward, update_weight, advantages (when computed), reward/<component>."""
        out: dict[str, list] = {REWARD: list(self.scores), UPDATE_WEIGHT: self.weights}
        if self.advantages is not None:
            out[ADVANTAGES] = self.advantages
        out.update({reward_component(k): v for k, v in self.components.items()})
        return out


class RewardTerm:
    """One feature of the reward stage: the dock columns it reads, and what it adds to a pull's groups."""

    columns: tuple[str, ...] = ()

    def apply(self, group: ScoredGroups) -> None:
        """Add this term's part to `group` (in place)."""
        raise NotImplementedError


class RuleRewards(RewardTerm):
    """reward.functions through the runner's process pool: the base of each row's total, each function's
    components, and its timeouts, errors and failed rows."""

    columns: tuple[str, ...] = (LABEL,)

    def __init__(self, runner: RewardRunner):
        self.runner = runner

    def apply(self, group: ScoredGroups) -> None:
        scores, components, stats = self.runner.score(group.prompts, group.responses, group.batch[LABEL])
        group.scores, group.components = scores, components
        group.timeouts += stats.get("timeouts", 0)
        group.errors += stats.get("errors", 0)
        group.failed = list(stats.get("failed", []))


class EnvReward(RewardTerm):
    """Multi-turn: `weight` (env.reward_weight) x the environment's final reward (component `env`, 0 where it gave
    none); rows whose environment raised are failed calls (score 0; reward.on_error decides their group)."""

    columns: tuple[str, ...] = (ENV_REWARD, ENV_FAILED)

    def __init__(self, weight: float):
        self.weight = weight

    def apply(self, group: ScoredGroups) -> None:
        given = [0.0 if math.isnan(r) else r for r in (float(x) for x in group.batch[ENV_REWARD])]
        group.scores = [s + self.weight * g for s, g in zip(group.scores, given)]
        group.components[ENV] = given
        failed = [i for i, f in enumerate(group.batch[ENV_FAILED]) if float(f) > 0]
        if failed:
            group.scores = [0.0 if i in failed else s for i, s in enumerate(group.scores)]
            group.failed = sorted(set(group.failed) | set(failed))
            group.errors += len(failed)


class Accuracy(RewardTerm):
    """What dynamic sampling filters on (ScoreResult.accuracy): a rule function's `<fn>/correct` when one
    reports it, else the total so far, before reward-model and overlong shaping."""

    def apply(self, group: ScoredGroups) -> None:
        key = accuracy_key(group.components)
        group.correct = list(group.components[key]) if key is not None else []
        group.accuracy = list(group.components[key]) if key is not None else list(group.scores)


class ModelScore(RewardTerm):
    """`weight` (reward.model.weight) x the reward model's score; the raw score is the `rm` component."""

    columns: tuple[str, ...] = (RM_SCORE,)

    def __init__(self, weight: float):
        self.weight = weight

    def apply(self, group: ScoredGroups) -> None:
        rm = [float(x) for x in group.batch[RM_SCORE]]
        group.scores = [s + self.weight * x for s, x in zip(group.scores, rm)]
        group.components[RM] = rm


class OverlongPenalty(RewardTerm):
    """DAPO's overlong shaping (algos/estimators.py `overlong_penalty`) on the response lengths; the penalty is
    also the `overlong` component. `masked` (multi-turn): a trajectory's length is the tokens its policy sampled
    (loss_mask 1), counted against the policy budget (config/budgets.py), never its observations."""

    def __init__(self, max_new_tokens: int | None, buffer_len: int, penalty: float, masked: bool = False):
        if max_new_tokens is None:
            raise ValueError("algo.overlong_buffer_len > 0 needs the RewardWorker's max_new_tokens")
        self.max_new_tokens, self.buffer_len, self.penalty = max_new_tokens, buffer_len, penalty
        self.masked = masked
        self.columns = (RESPONSE_IDS, LOSS_MASK) if masked else (RESPONSE_IDS,)

    def apply(self, group: ScoredGroups) -> None:
        if self.masked:
            lengths = torch.tensor([float(m.sum()) for m in group.batch[LOSS_MASK]])  # [N] sampled tokens
        else:
            lengths = torch.tensor([len(r) for r in group.batch[RESPONSE_IDS]])  # [N]
        penalty = overlong_penalty(lengths, self.max_new_tokens, self.buffer_len, self.penalty).tolist()
        group.scores = [s + p for s, p in zip(group.scores, penalty)]
        group.components[OVERLONG] = penalty


class DropFailedGroups(RewardTerm):
    """reward.on_error=drop_group: update weight 0 for every row of a group with a failed reward call."""

    def apply(self, group: ScoredGroups) -> None:
        size = group.group_size
        for i in group.failed:
            first = i - i % size
            group.weights[first : first + size] = [0.0] * size


class GroupAdvantages(RewardTerm):
    """The group estimator's advantage of each row's total, broadcast over the row's response tokens."""

    columns: tuple[str, ...] = (RESPONSE_IDS,)

    def __init__(self, estimator: str, settings: AdvantageSettings):
        self.estimator, self.settings = estimator_named(estimator), settings

    def apply(self, group: ScoredGroups) -> None:
        rewards = torch.tensor(group.scores, dtype=torch.float32)  # [N]
        adv = self.estimator.fn(rewards, group.group_size, self.settings)  # [N]
        group.advantages = [torch.full((len(r),), float(a)) for r, a in zip(group.batch[RESPONSE_IDS], adv)]


class TeacherTerm(RewardTerm):
    """On-policy distillation: each sampled token's advantage plus `coef` (distill.coef) x (teacher - rollout
    log-prob) (algos/distill.py); with `masked` (multi-turn) observation tokens, loss_mask 0, get none."""

    def __init__(self, coef: float, masked: bool):
        self.coef, self.masked = coef, masked
        self.columns = (TEACHER_LOGPROBS, ROLLOUT_LOGPROBS, *((LOSS_MASK,) if masked else ()))

    def apply(self, group: ScoredGroups) -> None:
        assert group.advantages is not None, "the teacher term adds to the estimator's: list it after that"
        masks = group.batch[LOSS_MASK] if self.masked else [None] * len(group.advantages)
        group.advantages = [
            adv + distill_advantages(teacher, student, self.coef, mask)
            for adv, teacher, student, mask in zip(
                group.advantages, group.batch[TEACHER_LOGPROBS], group.batch[ROLLOUT_LOGPROBS], masks
            )
        ]
