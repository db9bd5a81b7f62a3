"""What each worker stage returns to the driver: small typed records (the payload itself goes through the dock).

    ActorWorker.setup -> SetupResult          CriticWorker.setup -> SetupResult
    ActorWorker.generate -> GenerateResult    RewardWorker.score -> ScoreResult
    ActorWorker.compute_ref / compute_old -> LogprobResult
    ActorWorker.update -> UpdateResult        CriticWorker.compute_values -> LogprobResult
    CriticWorker.update -> UpdateResult       RewardModelWorker.score -> ModelScoreResult
    CriticWorker.save -> CriticState          ActorWorker.save -> str (the checkpoint path)
    TeacherWorker.setup -> SetupResult        TeacherWorker.score -> TeacherResult

One record per rank; recipes/step_metrics.py combines them. Metric dicts that are already
all-reduced across a group's ranks say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dockrl.algos.distill import DistillSums


@dataclass
class SetupResult:
    """A rank after setup: its model size, device and where it runs."""

    num_params: int
    device: str
    where: str


@dataclass
class GenerateResult:
    """One rank's rollout: the length of each response it produced (tp peers report none)."""

    response_lengths: list[int]
    truncated: int  # responses cut at rollout.max_new_tokens
    reshard_s: float  # the switch into the rollout layout, inside the rollout's time
    policy_version: int = -1  # separate placement: the trainer updates behind the weights that generated
    busy_s: float = (
        0.0  # separate placement: seconds this replica spent generating (its idle time is the rest)
    )
    interrupted: list[int] = field(default_factory=list)  # rollout.partial: rows cut at the pass's budget
    continued: int = 0  # rollout.partial: carried rows this pass continued
    env: dict[str, float] = field(default_factory=dict)  # multi-turn: summed env counters (multi_turn.py)
    # a backend that loads weights (vLLM): the update before this rollout (seconds, bytes, probe_abs_diff, digest_tensors); {}
    # when the engine reads the switch's weights in place
    weight_sync: dict[str, float] = field(default_factory=dict)


@dataclass
class LogprobResult:
    """One rank's share of a log-prob (or value) stage."""

    rows: int
    tokens: int = 0
    seconds: float = 0.0  # the rank's own time in the stage (its pull, forward and put)


@dataclass
class UpdateResult:
    """One rank's optimizer steps of an RL step; `metrics` are all-reduced across the group's ranks.

    Actor: loss, pg_loss, kl, entropy, clip_frac, approx_kl, grad_norm, lr (logged as actor/<key>).
    Critic: critic/<key> figures, and with algo.kl_in_reward reward/kl_penalty and reward/kl_coef.
    """

    metrics: dict[str, float]


@dataclass
class ScoreResult:
    """One RewardWorker's scoring of a step: per-row figures of the rows it scored, in its serving order."""

    rewards: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # row id of each entry of `rewards`
    correct: list[float] = field(default_factory=list)  # <fn>/correct of each row, when a function reports it
    overlong: list[float] = field(default_factory=list)  # DAPO overlong penalty of each row
    rm: list[float] = field(default_factory=list)  # raw reward-model score of each row
    timeouts: int = 0
    errors: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)  # a few rows for samples.jsonl
    dropped_groups: int = 0  # groups left out of the update for a failed reward call (reward.on_error)
    versions: list[int] = field(default_factory=list)  # the oldest policy_version of each scored row
    # What DAPO dynamic sampling filters on, per row: <fn>/correct when a function reports it, else the rule
    # reward before reward-model and overlong shaping.
    accuracy: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # update_weight of each row (0: its group is left out)


@dataclass
class ModelScoreResult:
    """One RewardModelWorker's scoring of a step."""

    scores: list[float]
    busy_s: float


@dataclass
class TeacherResult:
    """One TeacherWorker's scoring of a step: rows it put, its sums for distill/* (tp peers: none), busy time."""

    rows: int
    sums: DistillSums
    busy_s: float


@dataclass
class CriticState:
    """What the driver keeps of a critic at a checkpoint: PPO's KL controller coefficient."""

    kl_coef: float
