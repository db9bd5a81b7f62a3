"""RewardWorker: a CPU actor that scores whole groups as soon as they are generated.

    loop: pull whole groups (prompt_ids, response_ids, label[, rm_score]) ─▶ decode ─▶ reward functions
          (process pool, per-call timeout) ─▶ [+ reward.model.weight x rm_score] ─▶ [overlong shaping]
          ─▶ advantages of the algorithm's estimator (algos.compute_advantages)
          ─▶ [+ distill.coef x (teacher_logprobs - rollout_logprobs) per token (algos/distill.py)]
          ─▶ put reward, reward/<component>, advantages (not for ppo: its CriticWorker computes them)
    ends when the dock has no unserved rows for the `reward` consumer

Because it pulls whole groups while the actor still generates later ones, reward work overlaps rollout.
With a reward model (`reward.model.path`), a group is served once its `rm_score` is in the dock too
(workers/reward_model.py); reward.functions may then be empty. With a teacher (distill.teacher_path) a group is
served once its teacher_logprobs are in too (workers/teacher.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dockrl.algos.distill import distill_advantages
from dockrl.algos.estimators import compute_advantages, overlong_penalty
from dockrl.config.schema import AlgoConfig, RewardConfig
from dockrl.dock.choice import DockChoice
from dockrl.dock.columns import (
    ADVANTAGES,
    ENV_FAILED,
    ENV_REWARD,
    LABEL,
    LOSS_MASK,
    POLICY_VERSION,
    PROMPT_IDS,
    RESPONSE_IDS,
    REWARD,
    RM_SCORE,
    ROLLOUT_LOGPROBS,
    TEACHER_LOGPROBS,
    UPDATE_WEIGHT,
    reward_component,
)
from dockrl.dock.stages import Stage
from dockrl.engines.rollout.multi_turn import final_turn
from dockrl.models.tokenizer import Tokenizer
from dockrl.rewards.runner import RewardRunner, RewardSpec
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import ScoreResult


def reward_specs(cfg: RewardConfig) -> list[RewardSpec]:
    """Config entries -> runner specs."""
    return [
        RewardSpec(name=f.name, weight=f.weight, kwargs=dict(f.kwargs), code=f.code, origin=f.source_file)
        for f in cfg.functions
    ]


def accuracy_key(components: dict[str, list[float]]) -> str | None:
    """The component that says whether an answer is correct (`<fn>/correct`), if any function reports one."""
    return next((k for k in components if k.endswith("/correct")), None)


class RewardWorker(Worker):
    """Scores rows and computes GRPO advantages; one or more per job."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        reward: RewardConfig,
        algo: AlgoConfig,
        estimator: str | None,
        tokenizer_path: str,
        client: DockChoice,
        group_size: int,
        log_samples: int = 0,
        max_new_tokens: int | None = None,
        env_weight: float | None = None,
        distill_coef: float | None = None,
    ):
        """`estimator`: the group estimator of the run's step plan (StepPlan.estimator) when the reward workers
        compute advantages (StepPlan.advantages_by == "reward"), None when the critic does (gae).
        `distill_coef`: distill.coef when a teacher scores the rows (its term joins the advantages), else None."""
        super().__init__(name, rank, world_size, num_threads=1)
        self.cfg, self.algo, self.client, self.group_size = reward, algo, client, group_size
        self.log_samples = log_samples
        # The overlong-shaping limit (rollout.max_new_tokens); needed when algo.overlong_buffer_len > 0.
        self.max_new_tokens = max_new_tokens
        self.estimator = estimator
        # Multi-turn (env.name): reward functions read the final answer (the last policy turn), the
        # environment's final reward joins the total with this weight, and a failed environment is a failed
        # call; None for single-turn runs.
        self.env_weight = env_weight
        self.distill_coef = distill_coef
        self.tokenizer = Tokenizer.from_dir(tokenizer_path)
        specs = reward_specs(reward)
        self.runner = (
            RewardRunner(specs, timeout_s=reward.timeout_s, num_processes=reward.num_processes)
            if specs
            else None
        )
        # The weight of the reward model's score, None without a reward model.
        self.rm_weight = reward.model.weight if reward.model.path is not None else None

    def score(self, dock: int | None = None) -> ScoreResult:
        """Serve the `reward` consumer until every row is scored; returns per-row figures for metrics. `dock`:
        an asynchronous run's dock of this step, selected when this call starts (after the worker's earlier
        calls), so the driver never waits for a running score to switch docks."""
        if dock is not None:
            self.client.select(dock)
        n = self.group_size
        rewards: list[float] = []
        scored_rows: list[int] = []  # row id of each entry of `rewards` (DAPO dynamic sampling groups them)
        correct: list[float] = []
        overlong: list[float] = []
        rm: list[float] = []
        timeouts = errors = dropped_groups = 0
        samples: list[dict[str, Any]] = []
        versions: list[int] = []
        accuracy: list[float] = []  # what dynamic sampling filters on (ScoreResult.accuracy)
        row_weights: list[float] = []
        columns = [PROMPT_IDS, RESPONSE_IDS, LABEL, POLICY_VERSION]
        columns += [RM_SCORE] if self.rm_weight is not None else []
        columns += [LOSS_MASK, ENV_REWARD, ENV_FAILED] if self.env_weight is not None else []
        columns += [TEACHER_LOGPROBS, ROLLOUT_LOGPROBS] if self.distill_coef is not None else []
        while True:
            got = self.client.get(
                Stage.REWARD,
                columns,
                self.cfg.groups_per_pull * n,
                whole_groups=True,
                min_count=n,
            )
            if got is None:
                break
            rows, batch = got
            assert len({r // n for r in rows}) * n == len(rows), "the dock served a partial group"
            prompts = [self.tokenizer.decode(p.tolist()) for p in batch[PROMPT_IDS]]
            if self.env_weight is None:
                responses = [self.tokenizer.decode(r.tolist()) for r in batch[RESPONSE_IDS]]
            else:  # the final answer: the trajectory's last policy turn
                responses = [
                    self.tokenizer.decode(final_turn(r, m))
                    for r, m in zip(batch[RESPONSE_IDS], batch[LOSS_MASK])
                ]
            scores, components, stats = self._rule_rewards(prompts, responses, batch[LABEL])
            if self.env_weight is not None:
                scores, components, stats = self._add_env(scores, components, stats, batch)
            key = accuracy_key(components)
            accuracy += components[key] if key is not None else scores
            if self.rm_weight is not None:
                scores, components = self._add_model_score(scores, components, batch[RM_SCORE])
            if self.algo.overlong_buffer_len > 0:
                scores, components = self._shape_overlong(scores, components, batch[RESPONSE_IDS])
            weights = self._update_weights(len(rows), stats.get("failed", []))
            dropped_groups += weights[::n].count(0.0)
            row_weights += weights
            out: dict[str, list] = {REWARD: list(scores), UPDATE_WEIGHT: weights}
            if self.estimator is not None:  # None (gae, ppo): the critic turns rewards into advantages
                adv = compute_advantages(
                    self.estimator,
                    torch.tensor(scores, dtype=torch.float32),
                    n,
                    eps=self.algo.adv_eps,
                    normalize_std=self.algo.norm_adv_by_std,
                )
                out[ADVANTAGES] = [torch.full((len(r),), float(a)) for r, a in zip(batch[RESPONSE_IDS], adv)]
                if self.distill_coef is not None:
                    out[ADVANTAGES] = self._add_teacher_term(out[ADVANTAGES], batch)
            out.update({reward_component(k): v for k, v in components.items()})
            self.client.put(Stage.REWARD, rows, out)
            rewards += scores
            scored_rows += rows
            versions += [
                min(int(v) for v in tokens) if len(tokens) else -1 for tokens in batch[POLICY_VERSION]
            ]
            overlong += components.get("overlong", [])
            rm += components.get("rm", [])
            if key is not None:
                correct += components[key]
            timeouts += stats.get("timeouts", 0)
            errors += stats.get("errors", 0)
            for i in range(min(self.log_samples - len(samples), len(rows))):
                samples.append(
                    {
                        "row": rows[i],
                        "prompt": prompts[i],
                        "response": responses[i],
                        "label": _jsonable(batch[LABEL][i]),
                        "reward": scores[i],
                    }
                )
        return ScoreResult(
            rewards,
            scored_rows,
            correct,
            overlong,
            rm,
            timeouts,
            errors,
            samples,
            dropped_groups,
            versions,
            accuracy=accuracy,
            weights=row_weights,
        )

    def _add_env(
        self, scores: list[float], components: dict, stats: dict, batch: dict[str, list]
    ) -> tuple[list[float], dict, dict]:
        """Add env.reward_weight x the environment's final reward (component `env`, 0 where it gave none);
        rows whose environment raised count as failed calls (score 0; reward.on_error decides their group)."""
        env_rewards = [float(r) for r in batch[ENV_REWARD]]
        given = [0.0 if math.isnan(r) else r for r in env_rewards]
        assert self.env_weight is not None
        scores = [s + self.env_weight * g for s, g in zip(scores, given)]
        components = {**components, "env": given}
        failed = [i for i, f in enumerate(batch[ENV_FAILED]) if float(f) > 0]
        if failed:
            scores = [0.0 if i in failed else s for i, s in enumerate(scores)]
            stats = {**stats, "failed": sorted(set(stats.get("failed", [])) | set(failed))}
            stats["errors"] = stats.get("errors", 0) + len(failed)
        return scores, components, stats

    def _add_teacher_term(self, advantages: list[torch.Tensor], batch: dict[str, list]) -> list[torch.Tensor]:
        """Each row's advantages plus distill.coef x (teacher - rollout log-prob) of each sampled token
        (multi-turn observation tokens, loss_mask 0, get none)."""
        assert self.distill_coef is not None
        masks = batch[LOSS_MASK] if self.env_weight is not None else [None] * len(advantages)
        return [
            adv + distill_advantages(teacher, student, self.distill_coef, mask)
            for adv, teacher, student, mask in zip(
                advantages, batch[TEACHER_LOGPROBS], batch[ROLLOUT_LOGPROBS], masks
            )
        ]

    def _update_weights(self, num_rows: int, failed: list[int]) -> list[float]:
        """1 per row, or 0 for every row of a group with a failed reward call under reward.on_error=drop_group
        (rows come in whole groups of group_size)."""
        weights = [1.0] * num_rows
        if self.cfg.on_error == "drop_group":
            for i in failed:
                first = i - i % self.group_size
                weights[first : first + self.group_size] = [0.0] * self.group_size
        return weights

    def _rule_rewards(
        self, prompts: list[str], responses: list[str], labels: list
    ) -> tuple[list, dict, dict]:
        """Weighted rule rewards, components and stats; all zero when reward.functions is empty."""
        if self.runner is None:
            return [0.0] * len(prompts), {}, {}
        return self.runner.score(prompts, responses, labels)

    def _add_model_score(self, scores: list[float], components: dict, rm_scores: list) -> tuple[list, dict]:
        """Add reward.model.weight x rm_score to each total; the raw score is stored as the `rm` component."""
        rm = [float(x) for x in rm_scores]
        weight = self.rm_weight
        assert weight is not None  # called only with a reward model
        return [s + weight * x for s, x in zip(scores, rm)], {**components, "rm": rm}

    def _shape_overlong(self, scores: list[float], components: dict, response_ids: list) -> tuple[list, dict]:
        """Add DAPO's overlong penalty to each score; it is also stored as the `overlong` component."""
        if self.max_new_tokens is None:
            raise ValueError("algo.overlong_buffer_len > 0 needs the RewardWorker's max_new_tokens")
        lengths = torch.tensor([len(r) for r in response_ids])
        penalty = overlong_penalty(
            lengths, self.max_new_tokens, self.algo.overlong_buffer_len, self.algo.overlong_penalty
        ).tolist()
        return [s + p for s, p in zip(scores, penalty)], {**components, "overlong": penalty}

    def close(self) -> None:
        """Stop the reward process pool."""
        if self.runner is not None:
            self.runner.close()


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


class RewardGroup(WorkerGroup):
    """The RewardWorkers, one typed method per stage."""

    worker = RewardWorker

    def score(self, dock: int | None = None) -> Pending[ScoreResult]:
        """Score every row of the step (of dock `dock` in an asynchronous run) as its group is generated."""
        return self.start(RewardWorker.score, dock)

    def close(self) -> Pending[None]:
        """Stop the reward process pools."""
        return self.start(RewardWorker.close)
