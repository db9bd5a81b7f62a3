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
      └── metrics, samples, checkpoint, eval; dock reset

PPO (algo.name=ppo) adds the critic group (workers/critic.py); its reward workers put only `reward`, and the
actor skips its update during the first algo.critic_warmup_steps steps.

Each stage waits only for the columns it reads; the driver waits for each stage's small metric dicts.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from dockrl.checkpoint import directory
from dockrl.checkpoint.state import data_fingerprint
from dockrl.config.loader import to_dict
from dockrl.config.schema import TrainConfig
from dockrl.config.step_plan import StepPlan, rollout_lead, step_plan
from dockrl.dock.columns import RESPONSE_IDS
from dockrl.dock.errors import DockError
from dockrl.dock.metrics import bytes_moved, driver_bytes
from dockrl.engines.rollout.dock_feed import ROLLOUT
from dockrl.models.tokenizer import Tokenizer
from dockrl.observe.run_dir import RunDir, StageTimer
from dockrl.recipes.cluster import Cluster, check_placement, sync_rollout_weights
from dockrl.recipes.common import (
    EncodedPrompt,
    EpochSampler,
    RunFailed,
    describe,
    encode_prompts,
    init_ray,
)
from dockrl.recipes.dynamic_sampling import group_rewards, select_groups
from dockrl.recipes.eval import score_answers
from dockrl.recipes.inflight import Generation, load_inflight, save_inflight
from dockrl.recipes.resume import (
    ResumePoint,
    plan_resume,
    reference_path,
    restore,
    timeline_head,
    trainer_state,
)
from dockrl.workers.actor import ActorGroup
from dockrl.workers.fault_injection import FaultInjector
from dockrl.workers.group import WorkerError
from dockrl.workers.results import GenerateResult, ScoreResult, UpdateResult
from dockrl.workers.reward import reward_specs
from dockrl.workers.supervisor import WorkerFailure

log = logging.getLogger(__name__)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run a validated GRPO config; returns the summary (also written to the run directory).

    Resumes from a checkpoint with run.resume (recipes/resume.py). A worker or dock actor that dies or hangs
    stops the run within seconds with a RunFailed naming it, or, with run.max_restarts, restarts every worker
    and the dock and resumes from the newest checkpoint.
    """
    run = RunDir(cfg.run.output_dir, cfg.run.name)
    tokenizer = Tokenizer.from_dir(cfg.model.path)
    train_prompts, skipped = _encode(cfg, cfg.data.train_path, tokenizer)
    eval_prompts = (
        _encode(cfg, cfg.data.eval_path, tokenizer, cfg.data.eval_limit)[0] if cfg.data.eval_path else []
    )
    data = data_fingerprint([(p.ids, p.label) for p in train_prompts])
    point = plan_resume(cfg, run, data)  # before Ray starts: a changed config is refused here
    origin = point  # where this timeline starts; restarts continue from its newest checkpoint (timeline_head)
    reference = reference_path(cfg, point)  # the run's config stays the user's: the next resume compares it
    run.write_config(to_dict(cfg))
    init_ray(cfg.run.ray_address)
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
                cfg,
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
        cluster.close()
        break
    summary["eval_accuracy"] = summary.get("final_metrics", {}).get("eval/accuracy")
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
    plan = step_plan(cfg)
    with run.loggers(
        cfg.run.loggers, to_dict(cfg), first_step
    ):  # jsonl, and tensorboard/wandb/mlflow if asked
        for step in range(first_step, cfg.run.steps + 1):
            cluster.supervisor.step, cluster.supervisor.stage = step, "step"
            if rollout_lead(cfg):
                metrics, samples = _async_step(cfg, plan, step, sampler, cluster, ahead)
            else:
                metrics, samples = _step(cfg, plan, step, sampler, cluster)
            metrics["train/epoch"] = sampler.epoch + sampler.position / len(sampler.items)
            if restarts:
                metrics["run/restarts"] = float(restarts)
            if _due(step, cfg.run.eval_every, cfg.run.steps) and eval_prompts:
                cluster.supervisor.stage = "eval"
                metrics.update(_evaluate(cfg, cluster.actors, eval_prompts, tokenizer))
            run.log_metrics(step, metrics)
            run.log_samples(step, samples)
            if _due(step, cfg.run.save_every, cfg.run.steps):
                summary["checkpoint"] = _save(cfg, run, cluster, step, sampler, data, list(ahead.values()))
            progress.update(1)
            progress.set_postfix(
                reward=f"{metrics.get('reward/mean', float('nan')):.3f}",  # nan: rollout.partial cut every group
                acc=f"{metrics.get('train/accuracy', 0):.2f}",
            )
            summary.update({"steps": step, "final_metrics": metrics})
    progress.close()


def _save(
    cfg: TrainConfig,
    run: RunDir,
    cluster: Cluster,
    step: int,
    sampler: EpochSampler,
    data: str,
    inflight: list[Generation],
) -> str:
    """A resumable checkpoint of `step` (checkpoint/layout.py): the workers write their shards and exports
    into a staging directory (an asynchronous run's driver adds the generations in flight, recipes/inflight.py),
    the driver adds trainer_state.json and renames it, then prunes old ones."""
    cluster.supervisor.stage = "save"
    staging = directory.begin(run.checkpoints, step)
    actor_save = cluster.actors.save(str(staging))
    critic_state = cluster.critic.save(str(staging)).wait()[0] if cluster.critic is not None else None
    # save_inflight raises InflightSaveError rather than let a checkpoint that lacks rows be committed.
    if inflight or cfg.rollout.partial:
        save_inflight(staging, inflight, cluster.client, carried=cfg.rollout.partial)
    actor_save.wait()
    cluster.supervisor.at("save", "commit")
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
    return encode_prompts(
        path,
        tokenizer,
        prompt_field=d.prompt_field,
        label_field=d.label_field,
        system_prompt=d.system_prompt,
        use_chat_template=d.use_chat_template,
        max_prompt_len=d.max_prompt_len,
        limit=limit,
    )


def _step(cfg: TrainConfig, plan: StepPlan, step: int, sampler: EpochSampler, cluster: Cluster):
    """One RL step; returns (metrics, samples)."""
    actors, critic = cluster.actors, cluster.critic
    timer = StageTimer()
    with timer("step"):
        batch: list[EncodedPrompt] = sampler.next_batch()
        dapo: dict[str, float] = {}
        if cfg.algo.dynamic_sampling:  # group-baseline algorithms only: never with a critic
            batch, gen, scored, dapo = _sample_until_full(cfg, step, batch, sampler, cluster, timer)
            values = None
        else:
            gen, scored, values = _round(cfg, step, batch, cluster, timer)
        _logprob_stages(plan, actors, timer)
        critic_out: list[UpdateResult] = []
        if values is not None:
            with timer("critic_values"):  # what is left of it: it overlaps the log-prob stages
                values.wait()
        with timer("update"):
            # With ppo the actor's update waits in the dock for the critic's advantages, and the critic never
            # waits for the actor: so wait for the critic first, and its failure is reported at once rather
            # than as the actor's dock timeout.
            critic_update = critic.update() if critic is not None else None
            actor_update = actors.update() if plan.trains_actor(step) else None
            critic_out = critic_update.wait() if critic_update is not None else []
            updates = actor_update.wait() if actor_update is not None else []
        dock_stats = cluster.client.stats()
        if cfg.rollout.partial:  # cut groups stay, numbered first; their finished rows count as rolled out
            cluster.client.reset(keep_unfinished=RESPONSE_IDS, served_by=ROLLOUT)
        else:
            cluster.client.reset()
    metrics = _metrics(cfg, step, batch, gen, scored, updates, timer, dock_stats)
    metrics.update(dapo)
    metrics.update(critic_out[0].metrics if critic_out else {})  # already all-reduced across critic ranks
    return metrics, _samples(scored)


def _start_generation(cfg: TrainConfig, step: int, sampler: EpochSampler, cluster: Cluster) -> Generation:
    """Draw step `step`'s prompts into dock step mod (k+1) and start its rollout (on the separate replicas,
    with the weights after update step - 1 - k: fixed by the step number, so repeatable) and its scoring."""
    assert cluster.rollouts is not None
    k = rollout_lead(cfg)
    dock, version = step % (k + 1), max(0, step - 1 - k)
    batch = sampler.next_batch()
    cluster.client.select(dock)
    cluster.client.add_groups(
        [torch.tensor(p.ids) for p in batch], [p.label for p in batch], cfg.rollout.samples_per_prompt
    )
    synced_s = sync_rollout_weights(cluster, version)
    for group in (cluster.rollouts, cluster.rewards, cluster.reward_models):
        if group is not None:
            group.call("select_dock", dock)
    started = time.perf_counter()
    model_scoring = cluster.reward_models.score() if cluster.reward_models is not None else None
    pending = (cluster.rollouts.generate(step, version), cluster.rewards.score(), model_scoring)
    return Generation(step, version, dock, batch, started, synced_s, pending)


def _async_step(
    cfg: TrainConfig,
    plan: StepPlan,
    step: int,
    sampler: EpochSampler,
    cluster: Cluster,
    ahead: dict[int, Generation],
) -> tuple[dict[str, float], list[dict]]:
    """One step of an asynchronous run (rollout.max_staleness=k): wait for this step's generation (started
    during the last k steps' training), start step + k's with the weights of now (after update step - 1),
    then train on this step's rows while the next k steps generate. `ahead` (step -> Generation) holds the
    started generations; returns (metrics, samples)."""
    actors, k, last = cluster.actors, rollout_lead(cfg), cfg.run.steps
    timer = StageTimer()
    with timer("step"):
        for pending_step in range(step, min(step + k - 1, last) + 1):  # the first step (none started yet)
            if pending_step not in ahead:
                ahead[pending_step] = _start_generation(cfg, pending_step, sampler, cluster)
        current = ahead.pop(step)
        gen, scored, rollout_s = current.finish()
        timer.add("rollout", rollout_s)  # most of it overlapped earlier updates
        timer.add("weight_sync", current.weight_sync_s)
        wait_start = time.perf_counter()
        if step + k <= last:
            ahead[step + k] = _start_generation(cfg, step + k, sampler, cluster)
        timer.add("start_next", time.perf_counter() - wait_start)
        actors.call("select_dock", current.dock)
        _logprob_stages(plan, actors, timer)
        with timer("update"):
            updates = actors.update().wait()
        cluster.client.select(current.dock)
        dock_stats = cluster.client.stats()
        cluster.client.reset()
    metrics = _metrics(cfg, step, current.batch, gen, scored, updates, timer, dock_stats)
    return metrics, _samples(scored)


def _logprob_stages(plan: StepPlan, actors: ActorGroup, timer: StageTimer) -> None:
    """The reference and old log-prob stages the plan asks for, each timed."""
    if plan.reference:
        with timer("reference"):
            actors.compute_ref().wait()
    if plan.old_logprobs:
        with timer("old_logprobs"):
            actors.compute_old().wait()


def _round(cfg: TrainConfig, step: int, batch: list[EncodedPrompt], cluster: Cluster, timer: StageTimer):
    """Add `batch`'s groups, generate and score them (overlapped through the dock); returns (per-actor
    generate results, per-reward-worker score results, the critic's pending compute_values or None)."""
    n = cfg.rollout.samples_per_prompt
    cluster.client.add_groups([torch.tensor(p.ids) for p in batch], [p.label for p in batch], n)
    synced_s = sync_rollout_weights(cluster, version=step - 1)  # separate placement: the step's policy
    if synced_s:
        timer.add("weight_sync", synced_s)
    start = time.perf_counter()
    if cluster.rollouts is not None:
        generating = cluster.rollouts.generate(step, step - 1)
    else:
        generating = cluster.actors.generate(step)
    scoring = cluster.rewards.score()
    model_scoring = cluster.reward_models.score() if cluster.reward_models is not None else None
    gen = generating.wait()
    timer.add("rollout", time.perf_counter() - start)
    if cfg.rollout.partial:  # the groups of rows cut at the budget leave the step (the dock keeps them)
        cut = sorted({row // n for g in gen for row in g.interrupted})
        if cut:
            cluster.client.drop([group * n + i for group in cut for i in range(n)])
    values = cluster.critic.compute_values() if cluster.critic is not None else None
    if model_scoring is not None:  # the reward workers wait for rm_score, so this ends first
        model_scoring.wait()
        timer.add("reward_model", time.perf_counter() - start)  # overlaps rollout too
    scored = scoring.wait()
    timer.add("reward", time.perf_counter() - start)  # overlaps rollout; ends when the last group is scored
    return gen, scored, values


def _sample_until_full(cfg, step, batch, sampler, cluster: Cluster, timer: StageTimer):
    """DAPO dynamic sampling (recipes/dynamic_sampling.py): rounds of generate + score until
    prompts_per_step groups have reward spread; drops the other groups from the dock. Returns (every
    prompt generated this step, generate results, score results, dapo/* metrics)."""
    n, target = cfg.rollout.samples_per_prompt, cfg.run.prompts_per_step
    prompts, gen, scored = list(batch), [], []
    for rounds in range(1, cfg.algo.max_sampling_rounds + 1):
        round_gen, round_scored, _ = _round(cfg, step, batch, cluster, timer)
        gen, scored = gen + round_gen, scored + round_scored
        groups = group_rewards([r for s in scored for r in s.rows], [x for s in scored for x in s.rewards], n)
        missing = target - select_groups(groups, target, fill=False).informative
        if missing <= 0 or rounds == cfg.algo.max_sampling_rounds:
            break
        batch = sampler.next_batch(missing)
        prompts += batch
    selection = select_groups(groups, target, fill=True)
    if selection.drop:
        cluster.client.drop([first + i for first in selection.drop for i in range(n)])
    return (
        prompts,
        gen,
        scored,
        {
            "dapo/rounds": float(rounds),
            "dapo/generated_groups": float(len(groups)),
            "dapo/informative_groups": float(selection.informative),
            "dapo/filled_groups": float(selection.filled),
            "dapo/dropped_groups": float(len(selection.drop)),
        },
    )


def _metrics(
    cfg: TrainConfig,
    step: int,
    batch: list[EncodedPrompt],
    gen: list[GenerateResult],
    scored: list[ScoreResult],
    updates: list[UpdateResult],
    timer: StageTimer,
    dock_stats: dict,
) -> dict[str, float]:
    n = cfg.rollout.samples_per_prompt
    lengths = [x for g in gen for x in g.response_lengths]
    rewards = [x for s in scored for x in s.rewards]
    correct = [x for s in scored for x in s.correct]
    prompt_tokens = sum(len(p.ids) for p in batch) * n
    response_tokens = sum(lengths)
    m: dict[str, float] = {}
    m.update(describe([float(r) for r in rewards], "reward"))
    m.update(describe([float(x) for x in lengths], "response_length"))
    m["response_length/truncated_frac"] = sum(g.truncated for g in gen) / max(1, len(lengths))
    if correct:
        m["train/accuracy"] = statistics.fmean(correct)
    overlong = [x for s in scored for x in s.overlong]
    rm = [x for s in scored for x in s.rm]
    if rm:  # raw reward-model scores; reward/mean includes reward.model.weight x these
        m["reward/rm"] = statistics.fmean(rm)
    if overlong:  # DAPO overlong shaping: mean penalty (<= 0) and share of rows penalised
        m["reward/overlong_penalty"] = statistics.fmean(overlong)
        m["reward/overlong_frac"] = sum(x < 0 for x in overlong) / len(overlong)
    m["reward/timeouts"] = float(sum(s.timeouts for s in scored))
    m["reward/errors"] = float(sum(s.errors for s in scored))
    m["reward/dropped_groups"] = float(sum(s.dropped_groups for s in scored))  # reward.on_error=drop_group
    for key, value in updates[0].metrics.items() if updates else ():  # no actor update in ppo's warm-up
        m[key if "/" in key else f"actor/{key}"] = value  # already all-reduced across ranks
    m.update(timer.metrics())
    m["timing/reshard_to_rollout"] = max(g.reshard_s for g in gen)  # inside timing/rollout
    if any(g.busy_s for g in gen):  # separate replicas: their own generating time (the rest they idle)
        m["timing/rollout_busy"] = max(g.busy_s for g in gen)
    t = timer.seconds
    m["throughput/tokens_per_s"] = (prompt_tokens + response_tokens) / t["step"]
    m["throughput/rollout_tokens_per_s"] = response_tokens / max(t["rollout"], 1e-9)
    m["throughput/update_tokens_per_s"] = (prompt_tokens + response_tokens) / max(t["update"], 1e-9)
    if "reference" in t:
        m["throughput/reference_tokens_per_s"] = (prompt_tokens + response_tokens) / max(t["reference"], 1e-9)
    m["dock/bytes_in_warehouses"] = float(sum(w.get("bytes", 0) for w in dock_stats.get("warehouses", [])))
    m["dock/bytes_moved"] = float(bytes_moved(dock_stats))  # put + got at the warehouses this step
    m["dock/driver_bytes"] = float(driver_bytes(dock_stats))  # payload through the driver this step
    for op, latency in dock_stats.get("latency_ms", {}).items():  # controller service times
        m[f"dock/{op}_p99_ms"] = latency["p99_ms"]
    m["dock/rows"] = float(len(rewards))
    if cfg.rollout.max_staleness:
        # Staleness of each trained row: updates the trained policy (after step - 1 of them) is ahead of the
        # weights that sampled the row's oldest token.
        behind = [float(step - 1 - v) for s in scored for v in s.versions]
        m["async/staleness_mean"] = statistics.fmean(behind) if behind else 0.0
        m["async/staleness_max"] = max(behind, default=0.0)
    if cfg.rollout.partial:
        m["rollout/interrupted"] = float(sum(len(g.interrupted) for g in gen))  # rows cut this step
        m["rollout/continued"] = float(sum(g.continued for g in gen))  # carried rows continued this step
    m["tokens/prompt"] = float(prompt_tokens)
    m["tokens/response"] = float(response_tokens)
    return m


def _samples(scored: list[ScoreResult]) -> list[dict]:
    return [s for worker in scored for s in worker.samples]


def _evaluate(
    cfg: TrainConfig, actors: ActorGroup, prompts: list[EncodedPrompt], tokenizer: Tokenizer
) -> dict:
    """Greedy answers from the current policy (prompts split over the actor ranks), scored in the driver."""
    # One shard per rollout replica, given to its head rank (tp peers get theirs by broadcast, answer []).
    tp, replicas = cfg.rollout.tp, len(actors) // cfg.rollout.tp
    shards = [prompts[r // tp :: replicas] if r % tp == 0 else [] for r in range(len(actors))]
    outs = actors.evaluate([[p.ids for p in s] for s in shards], cfg.rollout.max_new_tokens).wait()
    ordered_prompts = [p for s in shards for p in s]
    responses = [tokenizer.decode(ids) for o in outs for ids in o]
    scored = score_answers(
        ordered_prompts, responses, reward_specs(cfg.reward), timeout_s=cfg.reward.timeout_s
    )
    return {"eval/accuracy": scored["accuracy"], "eval/reward_mean": scored["reward_mean"]}


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
