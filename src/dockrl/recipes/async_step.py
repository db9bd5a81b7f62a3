"""The asynchronous step schedule (config/schedule.py: async, rollout.max_staleness=k): generation runs k steps
ahead of training, each step in a dock of its own (step mod (k+1)).

    step t:  wait for Generation(t) ─▶ start Generation(t+k) ─▶ train on dock t mod (k+1) ─▶ reset that dock
               ▲ started k steps ago, with                      │ reference, old log-probs, update (actor)
               │ the weights after update t-1-k                 ▼
    Generation(s): draw prompts ─▶ dock s mod (k+1) ─▶ weights after update s-1-k to the rollout replicas
                   ─▶ rollout replicas generate, reward models, teacher and reward workers score
                      (while steps s-k.. train)

Which weights generate which step is fixed by the step number, never by timing, so runs repeat bit for bit.
`ahead` (step -> Generation, recipes/inflight.py) holds the started generations; a checkpoint saves them.
"""

from __future__ import annotations

import time

from dockrl.config.schedule import Schedule
from dockrl.config.schema import TrainConfig
from dockrl.config.step_plan import StepPlan
from dockrl.dock.stages import Stage
from dockrl.observe.run_dir import StageTimer
from dockrl.recipes.cluster import Cluster, sync_rollout_weights
from dockrl.recipes.common import EpochSampler, add_prompts
from dockrl.recipes.inflight import Generation
from dockrl.recipes.step_metrics import StepRecord
from dockrl.recipes.sync_step import logprob_stages
from dockrl.workers.results import GenerateResult, ScoreResult


def async_step(
    cfg: TrainConfig,
    plan: StepPlan,
    schedule: Schedule,
    step: int,
    sampler: EpochSampler,
    cluster: Cluster,
    ahead: dict[int, Generation],
) -> StepRecord:
    """One step: wait for this step's generation (started during the last k steps' training), start step +
    k's with the weights of now (after update step - 1), then train on this step's rows while the next k
    steps generate."""
    actors = cluster.actors
    timer = StageTimer()
    with timer(Stage.STEP):
        current, gen, scored = _take_generation(cfg, schedule, step, sampler, cluster, ahead, timer)
        actors.select_dock(current.dock)
        logprob_stages(plan, actors, timer)
        with timer(Stage.UPDATE):
            updates = actors.update().wait()
        cluster.client.select(current.dock)
        dock_stats = cluster.client.stats()
        cluster.client.reset()
    return StepRecord(
        step, current.batch, gen, scored, updates, timer.seconds, dock_stats, teacher=current.teacher
    )


def _take_generation(
    cfg: TrainConfig,
    schedule: Schedule,
    step: int,
    sampler: EpochSampler,
    cluster: Cluster,
    ahead: dict[int, Generation],
    timer: StageTimer,
) -> tuple[Generation, list[GenerateResult], list[ScoreResult]]:
    """This step's finished generation and its (generate, score) results; starts the generations of the
    steps up to step + k that have not started yet (at the first step: steps 1..k)."""
    k, last = schedule.lead, cfg.run.steps
    for pending_step in range(step, min(step + k - 1, last) + 1):  # the first step (none started yet)
        if pending_step not in ahead:
            ahead[pending_step] = _start_generation(cfg, schedule, pending_step, sampler, cluster)
    current = ahead.pop(step)
    gen, scored, rollout_s = current.finish()
    timer.add(Stage.ROLLOUT, rollout_s)  # most of it overlapped earlier updates
    timer.add(Stage.WEIGHT_SYNC, current.weight_sync_s)
    wait_start = time.perf_counter()
    if step + k <= last:
        ahead[step + k] = _start_generation(cfg, schedule, step + k, sampler, cluster)
    timer.add(Stage.START_NEXT, time.perf_counter() - wait_start)
    return current, gen, scored


def _start_generation(
    cfg: TrainConfig, schedule: Schedule, step: int, sampler: EpochSampler, cluster: Cluster
) -> Generation:
    """Draw step `step`'s prompts into dock step mod (k+1) and start its rollout (on the separate replicas,
    with the weights after update step - 1 - k: fixed by the step number, so repeatable) and its scoring."""
    assert cluster.rollouts is not None
    k = schedule.lead
    dock, version = step % (k + 1), max(0, step - 1 - k)
    batch = sampler.next_batch()
    cluster.client.select(dock)
    add_prompts(cluster.client, batch, cfg.rollout.samples_per_prompt)
    synced_s = sync_rollout_weights(cluster, version)
    started = time.perf_counter()
    # Each call names its dock, and a worker selects it when the call starts (after its running calls): the
    # driver queues steps t+1..t+k without waiting for the generations still running (k >= 2 overlaps k).
    model_scoring = cluster.reward_models.score(dock) if cluster.reward_models is not None else None
    teaching = cluster.teacher.score(dock) if cluster.teacher is not None else None
    generating = cluster.rollouts.generate(step, version, dock)
    pending = (generating, cluster.rewards.score(dock), model_scoring, teaching)
    return Generation(step, version, dock, batch, started, synced_s, pending)
