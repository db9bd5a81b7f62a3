"""The synchronous step schedule (config/schedule.py: sync and partial): one step's stages, back to back.

    sampler ─▶ batch ─▶ dock.add_groups ─▶ [separate placement: weights after update step - 1 to the replicas]
      ├─▶ actor ranks or rollout replicas: generate   ┐ overlap through the dock: each group is scored
      ├─▶ reward models, teacher, reward workers: score ┘ as soon as it is complete
      │     dynamic sampling: more rounds of new prompts until the batch is full, the other groups dropped
      │     partial rollout: the groups of cut rows leave the step (the dock keeps them for the next)
      ├─▶ critic: values                             ┐ overlap (ppo); the reference starts when generation
      ├─▶ actor ranks: reference, old log-probs       ┘ ends, beside the last groups' scoring (as the plan asks)
      ├─▶ critic update, actor update                   (the actor's skipped in ppo's critic warm-up)
      └─▶ dock stats, reset (partial: cut groups stay) ─▶ StepRecord

The driver waits for each stage's small results; the payload goes through the dock.
"""

from __future__ import annotations

import time
from typing import Any

from dockrl.config.schedule import Schedule
from dockrl.config.schema import TrainConfig
from dockrl.config.step_plan import StepPlan
from dockrl.dock.columns import RESPONSE_IDS
from dockrl.dock.stages import Stage
from dockrl.engines.rollout.dock_feed import ROLLOUT
from dockrl.observe.run_dir import StageTimer
from dockrl.recipes.cluster import Cluster, sync_rollout_weights
from dockrl.recipes.common import EncodedPrompt, EpochSampler, add_prompts
from dockrl.recipes.dynamic_sampling import group_rewards, select_groups
from dockrl.recipes.step_metrics import SamplingCounts, StepRecord
from dockrl.workers.actor import ActorGroup
from dockrl.workers.group import Pending
from dockrl.workers.results import GenerateResult, LogprobResult, ScoreResult, TeacherResult, UpdateResult


def sync_step(
    cfg: TrainConfig, plan: StepPlan, schedule: Schedule, step: int, sampler: EpochSampler, cluster: Cluster
) -> StepRecord:
    """One RL step of the synchronous schedule (see the module docstring)."""
    timer = StageTimer()
    with timer(Stage.STEP):
        batch: list[EncodedPrompt] = sampler.next_batch()
        sampling, values, reference = None, None, None
        if schedule.dynamic_sampling_rounds:  # group-baseline algorithms only: never with a critic
            # the reference waits for the rounds: their scores decide which groups stay in the dock
            rounds = _sample_until_full(cfg, schedule, step, batch, sampler, cluster, timer)
            batch, gen, scored, sampling, teacher = rounds
        else:
            gen, scored, values, teacher, reference = _round(cfg, schedule, step, batch, cluster, timer, plan)
        logprob_stages(plan, cluster.actors, timer, reference)
        if values is not None:
            with timer(Stage.CRITIC_VALUES):  # what is left of it: it overlaps the log-prob stages
                values.wait()
        updates, critic_updates = _update(plan, step, cluster, timer)
        dock_stats = _close(schedule, cluster)
    return StepRecord(
        step, batch, gen, scored, updates, timer.seconds, dock_stats, critic_updates, sampling, teacher
    )


def logprob_stages(
    plan: StepPlan, actors: ActorGroup, timer: StageTimer, reference: Started | None = None
) -> None:
    """The reference and old log-prob stages the plan asks for, each timed; `reference`: the reference stage
    started already (`_round`: at the end of generation), waited for here and timed by its slowest rank's own
    seconds (`Started.wait`)."""
    if reference is not None:
        reference.wait(timer)
    elif plan.reference:
        with timer(Stage.REFERENCE):
            actors.compute_ref().wait()
    if plan.old_logprobs:
        with timer(Stage.OLD_LOGPROBS):
            actors.compute_old().wait()


def _update(
    plan: StepPlan, step: int, cluster: Cluster, timer: StageTimer
) -> tuple[list[UpdateResult], list[UpdateResult]]:
    """The critic's and the actor's updates of the step; returns (actor results, critic results)."""
    with timer(Stage.UPDATE):
        # With ppo the actor's update waits in the dock for the critic's advantages, and the critic never
        # waits for the actor: so wait for the critic first, and its failure is reported at once rather
        # than as the actor's dock timeout.
        critic_update = cluster.critic.update() if cluster.critic is not None else None
        actor_update = cluster.actors.update() if plan.trains_actor(step) else None
        critic_out = critic_update.wait() if critic_update is not None else []
        updates = actor_update.wait() if actor_update is not None else []
    return updates, critic_out


def _close(schedule: Schedule, cluster: Cluster) -> dict[str, Any]:
    """The dock's stats of the step, then its reset; returns the stats."""
    dock_stats = cluster.client.stats()
    if schedule.partial:  # cut groups stay, numbered first; their finished rows count as rolled out
        cluster.client.reset(keep_unfinished=RESPONSE_IDS, served_by=ROLLOUT)
    else:
        cluster.client.reset()
    return dock_stats


class Started:
    """A log-prob stage started before the driver waits for it (it may end long before the driver looks)."""

    def __init__(self, stage: Stage, pending: Pending[LogprobResult]) -> None:
        self.stage, self.pending = stage, pending

    def wait(self, timer: StageTimer) -> list[LogprobResult]:
        """Its results; its slowest rank's own seconds go to `timer`."""
        results = self.pending.wait()
        timer.add(self.stage, max((result.seconds for result in results), default=0.0))
        return results


def _round(
    cfg: TrainConfig,
    schedule: Schedule,
    step: int,
    batch: list[EncodedPrompt],
    cluster: Cluster,
    timer: StageTimer,
    plan: StepPlan | None = None,
) -> tuple[list[GenerateResult], list[ScoreResult], Any, list[TeacherResult], Started | None]:
    """Add `batch`'s groups, generate and score them (overlapped through the dock); returns (per-actor
    generate results, per-reward-worker score results, the critic's pending compute_values or None, per-teacher-
    rank results, the reference stage or None). With `plan` asking for a reference, the actor ranks start it as
    soon as generation ends: it reads only the rows' tokens, so it runs beside the scoring of the last groups
    (the reward workers are other processes) instead of after it."""
    n = cfg.rollout.samples_per_prompt
    add_prompts(cluster.client, batch, n)
    synced_s = sync_rollout_weights(cluster, version=step - 1)  # separate placement: the step's policy
    if synced_s:
        timer.add(Stage.WEIGHT_SYNC, synced_s)
    start = time.perf_counter()
    if cluster.rollouts is not None:
        generating = cluster.rollouts.generate(step, step - 1)
    else:
        generating = cluster.actors.generate(step)
    scoring = cluster.rewards.score()
    model_scoring = cluster.reward_models.score() if cluster.reward_models is not None else None
    teaching = cluster.teacher.score() if cluster.teacher is not None else None
    gen = generating.wait()
    timer.add(Stage.ROLLOUT, time.perf_counter() - start)
    if schedule.partial:  # the groups of rows cut at the budget leave the step (the dock keeps them)
        cut = sorted({row // n for g in gen for row in g.interrupted})
        if cut:
            cluster.client.drop([group * n + i for group in cut for i in range(n)])
    values = cluster.critic.compute_values() if cluster.critic is not None else None
    reference = None
    if plan is not None and plan.reference:
        reference = Started(Stage.REFERENCE, cluster.actors.compute_ref())
    if model_scoring is not None:  # the reward workers wait for rm_score, so this ends first
        model_scoring.wait()
        timer.add(Stage.REWARD_MODEL, time.perf_counter() - start)  # overlaps rollout too
    teacher: list[TeacherResult] = []
    if teaching is not None:  # the reward workers wait for teacher_logprobs too
        teacher = teaching.wait()
        timer.add(Stage.TEACHER, time.perf_counter() - start)  # overlaps rollout too
    scored = scoring.wait()
    timer.add(Stage.REWARD, time.perf_counter() - start)  # overlaps rollout; ends at the last group
    return gen, scored, values, teacher, reference


def _sample_until_full(
    cfg: TrainConfig,
    schedule: Schedule,
    step: int,
    batch: list[EncodedPrompt],
    sampler: EpochSampler,
    cluster: Cluster,
    timer: StageTimer,
) -> tuple[list[EncodedPrompt], list[GenerateResult], list[ScoreResult], SamplingCounts, list[TeacherResult]]:
    """DAPO dynamic sampling (recipes/dynamic_sampling.py): rounds of generate + score until
    prompts_per_step groups have reward spread; drops the other groups from the dock. Returns (every
    prompt generated this step, generate results, score results, the rounds' counts, teacher results)."""
    n, target = cfg.rollout.samples_per_prompt, cfg.run.prompts_per_step
    most = schedule.dynamic_sampling_rounds
    prompts = list(batch)
    gen: list[GenerateResult] = []
    scored: list[ScoreResult] = []
    teacher: list[TeacherResult] = []
    for rounds in range(1, most + 1):
        round_gen, round_scored, _, round_teacher, _ = _round(cfg, schedule, step, batch, cluster, timer)
        gen, scored, teacher = gen + round_gen, scored + round_scored, teacher + round_teacher
        # DAPO keeps a group whose answers are partly right: correctness before any shaping, never a group
        # left out for a failed reward (recipes/dynamic_sampling.py).
        rows, weights = [r for s in scored for r in s.rows], [w for s in scored for w in s.weights]
        groups = group_rewards(rows, [x for s in scored for x in s.accuracy], n, weights)
        missing = target - select_groups(groups, target, fill=False).informative
        if missing <= 0 or rounds == most:
            break
        batch = sampler.next_batch(missing)
        prompts += batch
    selection = select_groups(groups, target, fill=True)
    if selection.drop:
        cluster.client.drop([first + i for first in selection.drop for i in range(n)])
    counts = SamplingCounts(rounds, len(groups), selection.informative, selection.filled, len(selection.drop))
    return prompts, gen, scored, counts, teacher
