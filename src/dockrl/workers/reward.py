"""RewardWorker: a CPU actor that scores whole groups as soon as they are generated.

    loop: pull whole groups (prompt_ids, response_ids, label, and the columns its terms read) ─▶ decode
          ─▶ the reward terms, in order (rewards/terms.py): reward functions (process pool, per-call timeout)
             [+ env reward] [+ reward.model.weight x rm_score] [+ overlong shaping] ─▶ advantages of the
             algorithm's estimator [+ distill.coef x (teacher_logprobs - rollout_logprobs) per token]
          ─▶ put reward, reward/<component>, update_weight, advantages (not for ppo: its CriticWorker computes them)
    ends when the dock has no unserved rows for the `reward` consumer

Because it pulls whole groups while the actor still generates later ones, reward work overlaps rollout.
With a reward model (`reward.model.path`), a group is served once its `rm_score` is in the dock too
(workers/reward_model.py); reward.functions may then be empty. With a teacher (distill.teacher_path) a group is
served once its teacher_logprobs are in too (workers/teacher.py).
"""

from __future__ import annotations

from typing import Any

from dockrl.algos.registry import AdvantageSettings
from dockrl.config.schema import RewardConfig
from dockrl.config.specs import RewardStageSpec
from dockrl.data.images import is_vision_model
from dockrl.dock.choice import DockChoice
from dockrl.dock.columns import IMAGE_REFS, LABEL, LOSS_MASK, POLICY_VERSION, PROMPT_IDS, RESPONSE_IDS
from dockrl.dock.stages import Stage
from dockrl.engines.rollout.multi_turn import final_turn, turn_runs
from dockrl.models.tokenizer import Tokenizer
from dockrl.rewards.runner import RewardRunner, RewardSpec, accuracy_key
from dockrl.rewards.terms import (
    OVERLONG,
    RM,
    Accuracy,
    DropFailedGroups,
    EnvReward,
    GroupAdvantages,
    ModelScore,
    OverlongPenalty,
    RewardTerm,
    RuleRewards,
    ScoredGroups,
    TeacherTerm,
)
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import ScoreResult

__all__ = ["RewardGroup", "RewardWorker", "accuracy_key", "reward_specs", "reward_terms"]


def reward_specs(cfg: RewardConfig) -> list[RewardSpec]:
    """Config entries -> runner specs."""
    return [
        RewardSpec(name=f.name, weight=f.weight, kwargs=dict(f.kwargs), code=f.code, origin=f.source_file)
        for f in cfg.functions
    ]


def reward_terms(spec: RewardStageSpec, runner: RewardRunner | None) -> list[RewardTerm]:
    """The reward stage's terms of a run, in the order they apply (rewards/terms.py); `runner`: the reward
    functions' runner, None when the run has none."""
    reward, algo = spec.reward, spec.algo
    terms: list[RewardTerm] = [RuleRewards(runner)] if runner is not None else []
    if spec.env_weight is not None:
        terms.append(EnvReward(spec.env_weight))
    terms.append(Accuracy())
    if reward.model.path is not None:
        terms.append(ModelScore(reward.model.weight))
    if algo.overlong_buffer_len > 0:
        terms.append(
            OverlongPenalty(
                spec.max_new_tokens,
                algo.overlong_buffer_len,
                algo.overlong_penalty,
                masked=spec.env_weight is not None,
            )
        )
    if reward.on_error == "drop_group":
        terms.append(DropFailedGroups())
    if spec.estimator is not None:  # None (gae, ppo): the critic turns rewards into advantages
        terms.append(GroupAdvantages(spec.estimator, AdvantageSettings(algo.adv_eps, algo.norm_adv_by_std)))
        if spec.distill_coef is not None:
            terms.append(TeacherTerm(spec.distill_coef, masked=spec.env_weight is not None))
    return terms


class RewardWorker(Worker):
    """Scores rows and computes GRPO advantages; one or more per job."""

    def __init__(self, name: str, rank: int, world_size: int, *, spec: RewardStageSpec, client: DockChoice):
        """`spec`: config/specs.py (its estimator is None when the critic computes advantages, its env_weight
        None for single-turn runs: reward functions then read the whole response, not the final turn)."""
        super().__init__(name, rank, world_size, num_threads=1)
        reward = spec.reward
        self.cfg, self.client, self.group_size = reward, client, spec.group_size
        self.log_samples = spec.log_samples
        self.env_weight = spec.env_weight
        self.tokenizer = Tokenizer.from_dir(spec.tokenizer_path)
        # A vision-language model's rows carry image_refs (the driver's data pass, recipes/common.add_prompts)
        self.images = is_vision_model(spec.tokenizer_path)
        functions = reward_specs(reward)
        self.runner = (
            RewardRunner(
                functions,
                timeout_s=reward.timeout_s,
                num_processes=reward.num_processes,
                inline=reward.inline,
            )
            if functions
            else None
        )
        self.terms = reward_terms(spec, self.runner)
        # What a pull reads: the text to decode (multi-turn: its loss_mask marks the last policy turn), the
        # policy versions, and every term's columns.
        own = [
            PROMPT_IDS,
            RESPONSE_IDS,
            LABEL,
            POLICY_VERSION,
            *([LOSS_MASK] if spec.env_weight is not None else []),
            *([IMAGE_REFS] if self.images else []),
        ]
        self.columns = list(dict.fromkeys(own + [c for term in self.terms for c in term.columns]))

    def score(self, dock: int | None = None) -> ScoreResult:
        """Serve the `reward` consumer until every row is scored; returns per-row figures for metrics. `dock`:
        an asynchronous run's dock of this step, selected when this call starts (after the worker's earlier
        calls), so the driver never waits for a running score to switch docks."""
        if dock is not None:
            self.client.select(dock)
        n, result = self.group_size, ScoreResult()
        while True:
            got = self.client.get(
                Stage.REWARD, self.columns, self.cfg.groups_per_pull * n, whole_groups=True, min_count=n
            )
            if got is None:
                return result
            rows, batch = got
            assert len({r // n for r in rows}) * n == len(rows), "the dock served a partial group"
            group = ScoredGroups(batch, *self._decode(batch), group_size=n)
            for term in self.terms:
                term.apply(group)
            self.client.put(Stage.REWARD, rows, group.columns_out())
            self._record(result, rows, group)

    def _decode(self, batch: dict[str, list]) -> tuple[list[str], list[str]]:
        """The prompts and responses of a pull as text (multi-turn: the final answer, the last policy turn)."""
        prompts = [self.tokenizer.decode(p.tolist()) for p in batch[PROMPT_IDS]]
        if self.env_weight is None:
            return prompts, [self.tokenizer.decode(r.tolist()) for r in batch[RESPONSE_IDS]]
        return prompts, [
            self.tokenizer.decode(final_turn(r, m)) for r, m in zip(batch[RESPONSE_IDS], batch[LOSS_MASK])
        ]

    def _record(self, result: ScoreResult, rows: list[int], group: ScoredGroups) -> None:
        """Add one pull's per-row figures (and a few sample rows) to the step's result."""
        result.rewards += group.scores
        result.rows += rows
        result.correct += group.correct
        result.overlong += group.components.get(OVERLONG, [])
        result.rm += group.components.get(RM, [])
        result.timeouts += group.timeouts
        result.errors += group.errors
        result.dropped_groups += group.weights[:: group.group_size].count(0.0)
        result.versions += [
            min(int(v) for v in tokens) if len(tokens) else -1 for tokens in group.batch[POLICY_VERSION]
        ]
        result.accuracy += group.accuracy
        result.weights += group.weights
        for i in range(min(self.log_samples - len(result.samples), len(rows))):
            sample = {
                "row": rows[i],
                "prompt": group.prompts[i],
                "response": group.responses[i],
                "label": _jsonable(group.batch[LABEL][i]),
                "reward": group.scores[i],
            }
            if self.images:  # which images the row had, as references (never pixels)
                sample["images"] = list(group.batch[IMAGE_REFS][i])
            if self.env_weight is not None:  # multi-turn: the whole trajectory, turn by turn
                sample.update(self._trajectory(group, i))
            result.samples.append(sample)

    def _trajectory(self, group: ScoredGroups, i: int) -> dict[str, Any]:
        """Row `i`'s turns ({"role": "assistant" or "observation", "text", "tokens"}), its environment reward and
        its reward components, for samples.jsonl."""
        runs = turn_runs(group.batch[RESPONSE_IDS][i], group.batch[LOSS_MASK][i])
        turns = [
            {
                "role": "assistant" if sampled else "observation",
                "text": self.tokenizer.decode(ids, skip_special_tokens=False),
                "tokens": len(ids),
            }
            for sampled, ids in runs
        ]
        components = {name: values[i] for name, values in group.components.items()}
        return {"turns": turns, "components": components}

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
