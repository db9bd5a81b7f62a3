"""GRPO, read top to bottom. The driver moves metadata; every payload goes through the transfer dock.

    driver ── add_groups(prompts x n) ──▶ dock (controller: metadata │ warehouses: payload)
      │
      ├─▶ actor ranks  : sync weights ─▶ pull whole groups ─▶ sample ─▶ put response_ids      ┐ overlap:
      ├─▶ reward models : pull finished groups ─▶ score head ─▶ put rm_score  (reward.model) │ groups flow
      ├─▶ reward workers: pull finished groups ─▶ score ─▶ put reward, advantages            ┘ as ready
      ├─▶ actor ranks  : pull rows/dp ─▶ reference log-probs ─▶ put ref_logprobs            (kl_coef > 0)
      ├─▶ actor ranks  : pull rows/dp ─▶ old log-probs ─▶ put old_logprobs   (off-policy, or ppo's KL in reward)
      ├─▶ critic ranks : pull rows/dp ─▶ values ─▶ put values        (ppo; overlaps the log-prob stages)
      ├─▶ critic ranks : pull rows/dp ─▶ token rewards, GAE ─▶ put advantages, returns ─▶ value updates   ┐ (ppo)
      ├─▶ actor ranks  : pull rows/dp ─▶ mini-batches x epochs of clipped-surrogate updates            ┘ overlap
      └── dock stats, reset ─▶ StepRecord ─▶ metrics, samples, eval, checkpoint

PPO (algo.name=ppo) adds the critic group (workers/critic.py); its reward workers put only `reward`, and the
actor skips its update during the first algo.critic_warmup_steps steps.

This file is the run loop: start the cluster, run the steps, evaluate, log, checkpoint, restart on a worker
failure. The step itself is a schedule, decided once in the step plan (config/schedule.py):

    sync, partial ─▶ recipes/sync_step.py    the stages above back to back (dynamic sampling: rounds)
    async (k)     ─▶ recipes/async_step.py   the rollout k steps ahead of the update, in docks of its own

Each stage waits only for the columns it reads; the driver waits for each stage's small results, and
recipes/step_metrics.py turns the step's record into its metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dockrl.checkpoint import directory
from dockrl.checkpoint.state import data_fingerprint
from dockrl.config.loader import to_dict
from dockrl.config.resolve import Resolved
from dockrl.config.schedule import Schedule
from dockrl.config.schema import TrainConfig
from dockrl.config.specs import env_spec
from dockrl.config.step_plan import StepPlan
from dockrl.dock.errors import DockError
from dockrl.dock.stages import Stage
from dockrl.models.tokenizer import Tokenizer
from dockrl.observe import metric_names as names
from dockrl.observe import startup
from dockrl.observe.run_dir import RunDir
from dockrl.recipes.common import (
    EncodedPrompt,
    EpochSampler,
    RunFailed,
    check_prompt_room,
    encode_prompts,
    init_ray,
)
from dockrl.recipes.resume import (
    ResumePoint,
    plan_resume,
    reference_path,
    restore,
    timeline_head,
    trainer_state,
)
from dockrl.workers.fault_injection import FaultInjector
from dockrl.workers.supervisor import WorkerError, WorkerFailure

if TYPE_CHECKING:
    from dockrl.recipes.cluster import Cluster
    from dockrl.recipes.inflight import Generation
    from dockrl.recipes.step_metrics import StepRecord
    from dockrl.workers.actor import ActorGroup

# What the run loop needs once Ray is up: torch, the workers' classes, the step schedules. init_ray imports
# them in a thread beside Ray's start, so the driver's seconds of imports overlap the seconds Ray takes to
# come up; the functions below import from them where they use them.
RUN_MODULES = (
    "dockrl.recipes.cluster",
    "dockrl.recipes.sync_step",
    "dockrl.recipes.async_step",
    "dockrl.recipes.inflight",
    "dockrl.recipes.step_metrics",
    "dockrl.recipes.eval",
)

log = logging.getLogger(__name__)


def train(resolved: Resolved) -> dict[str, Any]:
    """Run a resolved GRPO config (recipes/preflight.py); returns the summary (also written to the run directory).

    Resumes from a checkpoint with run.resume (recipes/resume.py). A worker or dock actor that dies or hangs
    stops the run within seconds with a RunFailed naming it, or, with run.max_restarts, restarts every worker
    and the dock and resumes from the newest checkpoint.
    """
    cfg = resolved.cfg
    startup.mark("config")
    run = RunDir(cfg.run.output_dir, cfg.run.name)
    tokenizer = Tokenizer.from_dir(cfg.model.path)
    train_prompts, skipped = _encode(cfg, cfg.data.train_path, tokenizer)
    eval_prompts = (
        _encode(cfg, cfg.data.eval_path, tokenizer, cfg.data.eval_limit)[0] if cfg.data.eval_path else []
    )
    pixels = (
        None
        if not train_prompts or train_prompts[0].image_patches is None
        else [p.image_patches.numpy().tobytes() + p.image_grid_thw.numpy().tobytes() for p in train_prompts]
    )
    data = data_fingerprint([(p.ids, p.label) for p in train_prompts], pixels)
    point = plan_resume(cfg, run, data)  # before Ray starts: a changed config is refused here
    origin = point  # where this timeline starts; restarts continue from its newest checkpoint (timeline_head)
    reference = reference_path(cfg, point)  # the run's config stays the user's: the next resume compares it
    run.write_config(to_dict(cfg))
    startup.mark("data")
    init_ray(cfg.run.ray_address, beside=RUN_MODULES)
    startup.mark("ray")
    from dockrl.recipes.cluster import Cluster, check_placement
    from dockrl.recipes.inflight import load_inflight

    check_placement(cfg)  # placement.* against the nodes' resources, before any worker starts
    faults = FaultInjector()
    summary: dict[str, Any] = {"run_dir": str(run.path), "skipped_prompts": skipped, "restarts": []}
    fresh = cfg.run.resume == "auto"
    while True:
        sampler = EpochSampler(
            train_prompts, cfg.run.prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.run.seed
        )
        first_step = restore(point, run, sampler, fresh=fresh)
        cluster: Cluster | None = None
        try:
            cluster = Cluster.start(
                resolved,
                resume_from=None if point is None else str(point.path),
                kl_coef=None if point is None else point.kl_coef,
                faults=faults,
                reference_path=reference,
            )
            summary["worker_nodes"] = cluster.worker_nodes()
            ahead = {}  # an asynchronous run's generations in flight at the checkpoint, back in their docks
            if point is not None:  # rows of steps generated ahead, or partial rollout's carried groups
                ahead = load_inflight(point.path, cluster.client, cfg.rollout.samples_per_prompt)
            args = (sampler, first_step, eval_prompts, tokenizer, summary, data, ahead)
            _run_steps(cfg, run, cluster, *args)
        except (WorkerError, DockError) as exc:
            failure = _root_cause(exc, cluster)
            if cluster is not None:
                cluster.kill()
            restarts = summary["restarts"]
            if not isinstance(failure, WorkerFailure) or len(restarts) >= cfg.run.max_restarts:
                raise _run_failed(failure, run, timeline_head(run, origin)) from None
            point, fresh = timeline_head(run, origin), True
            restarts.append({"cause": str(failure), "resume_from": str(point.path) if point else None})
            log.warning(
                "restart %d of run.max_restarts=%d after: %s; resuming from %s",
                len(restarts),
                cfg.run.max_restarts,
                failure,
                point.path if point else "the start (no checkpoint yet)",
            )
            continue
        except BaseException:
            if cluster is not None:
                cluster.kill()
            raise
        startup.mark("steps")
        cluster.close()
        startup.mark("close")
        break
    summary["startup"] = startup.phases()
    summary["eval_accuracy"] = summary.get("final_metrics", {}).get(names.EVAL_ACCURACY)
    run.write_summary(summary)
    return summary


def _run_steps(
    cfg: TrainConfig,
    run: RunDir,
    cluster: Cluster,
    sampler: EpochSampler,
    first_step: int,
    eval_prompts: list[EncodedPrompt],
    tokenizer: Tokenizer,
    summary: dict[str, Any],
    data: str,
    ahead: dict[int, Generation],
) -> None:
    """Steps first_step..run.steps: step, evaluate, log, checkpoint. `ahead`: an asynchronous run's started
    generations (step -> Generation; those of the checkpoint resumed from, at first)."""
    progress = _progress(cfg, first_step - 1)
    restarts = len(summary["restarts"])
    schedule = cluster.plan.schedule
    take_step = _step_function(cfg, cluster.plan, schedule, sampler, cluster, ahead)
    with run.loggers(
        cfg.run.loggers, to_dict(cfg), first_step
    ):  # jsonl, and tensorboard/wandb/mlflow if asked
        startup.mark("loggers")
        for step in range(first_step, cfg.run.steps + 1):
            cluster.supervisor.step, cluster.supervisor.stage = step, Stage.STEP
            record = take_step(step)
            metrics = _metrics(cfg, schedule, record, sampler, restarts)
            if _due(step, cfg.run.eval_every, cfg.run.steps) and eval_prompts:
                cluster.supervisor.stage = Stage.EVAL
                metrics.update(_evaluate(cfg, cluster.actors, eval_prompts, tokenizer))
            run.log_metrics(step, metrics)
            run.log_samples(step, record.samples)
            if step == first_step:
                startup.mark("first step")
            if _due(step, cfg.run.save_every, cfg.run.steps):
                summary["checkpoint"] = _save(cfg, run, cluster, step, sampler, data, list(ahead.values()))
            progress.update(1)
            progress.set_postfix(
                reward=f"{metrics.get(names.REWARD_MEAN, float('nan')):.3f}",  # nan: partial cut every group
                acc=f"{metrics.get(names.TRAIN_ACCURACY, 0):.2f}",
            )
            summary.update({"steps": step, "final_metrics": metrics})
    progress.close()


def _step_function(
    cfg: TrainConfig,
    plan: StepPlan,
    schedule: Schedule,
    sampler: EpochSampler,
    cluster: Cluster,
    ahead: dict[int, Generation],
) -> Callable[[int], StepRecord]:
    """The schedule's step (step number -> its record), chosen once for the run."""
    from dockrl.recipes.async_step import async_step
    from dockrl.recipes.sync_step import sync_step

    if schedule.kind == "async":
        return lambda step: async_step(cfg, plan, schedule, step, sampler, cluster, ahead)
    return lambda step: sync_step(cfg, plan, schedule, step, sampler, cluster)


def _metrics(
    cfg: TrainConfig, schedule: Schedule, record: StepRecord, sampler: EpochSampler, restarts: int
) -> dict[str, float]:
    """The step's metrics (recipes/step_metrics.py), and the run loop's: epoch, restarts so far."""
    from dockrl.recipes.step_metrics import step_metrics

    metrics = step_metrics(
        record,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        staleness=schedule.off_policy_rows,
        partial=schedule.partial,
    )
    metrics[names.TRAIN_EPOCH] = sampler.epoch + sampler.position / len(sampler.items)
    if restarts:
        metrics[names.RUN_RESTARTS] = float(restarts)
    return metrics


def _save(
    cfg: TrainConfig,
    run: RunDir,
    cluster: Cluster,
    step: int,
    sampler: EpochSampler,
    data: str,
    inflight: list[Generation],
) -> str:
    """A resumable checkpoint of `step` (checkpoint/directory.py): the workers write their shards and exports
    into a staging directory (an asynchronous run's driver adds the generations in flight, recipes/inflight.py),
    the driver adds trainer_state.json and renames it, then prunes old ones."""
    from dockrl.recipes.inflight import save_inflight

    cluster.supervisor.stage = Stage.SAVE
    staging = directory.begin(run.checkpoints, step)
    actor_save = cluster.actors.save(str(staging))
    critic_state = cluster.critic.save(str(staging)).wait()[0] if cluster.critic is not None else None
    # save_inflight raises InflightSaveError rather than let a checkpoint that lacks rows be committed.
    if inflight or cfg.rollout.partial:
        save_inflight(staging, inflight, cluster.client, carried=cfg.rollout.partial)
    actor_save.wait()
    cluster.supervisor.at(Stage.SAVE, "commit")
    kl_coef = critic_state.kl_coef if critic_state else None
    state = trainer_state(
        cfg, step, sampler, data, kl_coef, cluster.reference_path, cluster.parent_checkpoint
    )
    final = directory.commit(staging, state)
    cluster.parent_checkpoint = str(final)
    directory.prune(run.checkpoints, cfg.run.keep_checkpoints, newest=final)
    return str(final)


def _root_cause(exc: Exception, cluster: Cluster | None) -> Exception:
    """A worker that raised because a peer died (a dock read of a dead warehouse, a collective with a dead
    rank) is reported as that peer's death: the supervisor is asked who died before the raise is believed."""
    if isinstance(exc, WorkerFailure) or cluster is None:
        return exc
    try:
        cluster.supervisor.find_dead()
    except WorkerFailure as failure:
        return failure
    return exc


def _run_failed(exc: Exception, run: RunDir, head: ResumePoint | None) -> RunFailed:
    """The one-line error a failed run ends with: what failed, and how to resume it (`head`: the newest
    checkpoint of the run's timeline, recipes/resume.timeline_head)."""
    details = getattr(exc, "remote_traceback", None)
    errors = run.path / "errors.log"
    with open(errors, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {exc}\n{details or ''}\n")
    if head is None:
        resume = "run.resume=auto (no checkpoint yet: it starts over)"
    elif head.path.resolve().parent == run.checkpoints.resolve():
        resume = f"run.resume=auto (newest checkpoint: step {head.step})"
    else:  # resumed from another run's checkpoint and failed before its own first save
        resume = f"run.resume={head.path} (no checkpoint of this run yet)"
    return RunFailed(
        f"{exc}. Resume with: dockrl train ... run.name={run.path.name} {resume}; details in {errors}"
    )


def _encode(cfg: TrainConfig, path: str, tokenizer: Tokenizer, limit: int | None = None):
    d = cfg.data
    make_env = None
    env = env_spec(cfg.env, d.system_prompt, cfg.rollout.max_new_tokens)
    # multi-turn: the first turn is the environment's, rendered with its tools (an agent's rollout puts its own)
    from dockrl.data.images import vision_processor
    from dockrl.envs.loader import is_agent
    from dockrl.models.config import read_config

    args = read_config(cfg.model.path)
    agent = env is not None and is_agent(env)
    if env is not None and not agent:
        from dockrl.envs.loader import factory_of

        make_env = factory_of(env, args.family)
    prompts, skipped = encode_prompts(
        path,
        tokenizer,
        prompt_field=d.prompt_field,
        label_field=d.label_field,
        system_prompt=d.system_prompt,
        use_chat_template=d.use_chat_template,
        max_prompt_len=d.max_prompt_len,
        limit=limit,
        make_env=make_env,
        agent=agent,
        processor=vision_processor(cfg.model.path),
        model_path=cfg.model.path,
    )
    check_prompt_room(
        path,
        prompts,
        max_positions=args.max_position_embeddings,
        max_new_tokens=cfg.rollout.max_new_tokens,
        trajectory=None if env is None else env.max_response_tokens,
    )
    return prompts, skipped


def _evaluate(
    cfg: TrainConfig, actors: ActorGroup, prompts: list[EncodedPrompt], tokenizer: Tokenizer
) -> dict:
    """Greedy answers from the current policy (prompts split over the actor ranks), scored in the driver."""
    from dockrl.recipes.eval import prompt_images, score_answers
    from dockrl.workers.reward import reward_specs

    # One shard per rollout replica, given to its head rank (tp peers get theirs by broadcast, answer []).
    tp, replicas = cfg.rollout.tp, len(actors) // cfg.rollout.tp
    shards = [prompts[r // tp :: replicas] if r % tp == 0 else [] for r in range(len(actors))]
    env_shards = [[p.env_row or {} for p in s] for s in shards] if cfg.env.name is not None else None
    # A vision model's prompts carry their images (uint8 patches, grid), as the rollout's dock rows do.
    vision = bool(prompts) and prompts[0].image_patches is not None
    image_shards = [prompt_images(s) or [] for s in shards] if vision else None
    outs = actors.evaluate(
        [[p.ids for p in s] for s in shards], cfg.rollout.max_new_tokens, env_shards, image_shards
    ).wait()
    ordered_prompts = [p for s in shards for p in s]
    responses = [tokenizer.decode(ids) for o in outs for ids in o]
    scored = score_answers(
        ordered_prompts, responses, reward_specs(cfg.reward), timeout_s=cfg.reward.timeout_s
    )
    return {names.EVAL_ACCURACY: scored["accuracy"], names.EVAL_REWARD_MEAN: scored["reward_mean"]}


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _progress(cfg: TrainConfig, done: int = 0):
    from tqdm.auto import tqdm

    return tqdm(
        total=cfg.run.steps,
        initial=done,
        desc="grpo",
        unit="step",
        disable=not cfg.run.progress,
        dynamic_ncols=True,
    )
