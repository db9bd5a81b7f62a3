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
import os
import statistics
import time
from typing import Any

import torch

from dockrl.config.loader import to_dict
from dockrl.config.schema import RunConfig, TrainConfig
from dockrl.dock.launch import launch_dock
from dockrl.dock.metrics import bytes_moved, driver_bytes
from dockrl.models.tokenizer import Tokenizer
from dockrl.observe.run_dir import RunDir, StageTimer
from dockrl.recipes.common import EncodedPrompt, EpochSampler, describe, encode_prompts, init_ray
from dockrl.recipes.dynamic_sampling import group_rewards, select_groups
from dockrl.recipes.eval import score_answers
from dockrl.workers.actor import ActorWorker
from dockrl.workers.critic import CriticWorker
from dockrl.workers.group import WorkerError, WorkerGroup
from dockrl.workers.reward import RewardWorker, reward_specs
from dockrl.workers.reward_model import RewardModelWorker

log = logging.getLogger(__name__)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run a validated GRPO config; returns the summary (also written to the run directory)."""
    run = RunDir(cfg.run.output_dir, cfg.run.name)
    run.write_config(to_dict(cfg))
    tokenizer = Tokenizer.from_dir(cfg.model.path)
    train_prompts, skipped = _encode(cfg, cfg.data.train_path, tokenizer)
    eval_prompts = (
        _encode(cfg, cfg.data.eval_path, tokenizer, cfg.data.eval_limit)[0] if cfg.data.eval_path else []
    )
    sampler = EpochSampler(
        train_prompts, cfg.run.prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.run.seed
    )

    init_ray(cfg.run.ray_address)
    dock = launch_dock(
        mode=cfg.dock.mode,
        num_warehouses=cfg.dock.num_warehouses,
        get_timeout_s=cfg.dock.get_timeout_s,
        policy=cfg.dock.policy,
        max_rows=cfg.dock.max_rows,
        transport=cfg.dock.transport,
    )
    client = dock.client()
    actors, rewards = _start_workers(cfg, dock)
    reward_models: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    summary: dict[str, Any] = {"run_dir": str(run.path), "skipped_prompts": skipped}
    try:
        reward_models = _start_reward_models(cfg, dock)
        critic = _start_critic(cfg, dock)
        actors.call("setup")
        if critic is not None:
            critic.call("setup")
        progress = _progress(cfg)
        for step in range(1, cfg.run.steps + 1):
            metrics, samples = _step(cfg, step, sampler, client, actors, rewards, reward_models, critic)
            metrics["train/epoch"] = sampler.epoch + sampler.position / len(train_prompts)
            if _due(step, cfg.run.eval_every, cfg.run.steps) and eval_prompts:
                metrics.update(_evaluate(cfg, actors, eval_prompts, tokenizer))
            run.log_metrics(step, metrics)
            run.log_samples(step, samples)
            if _due(step, cfg.run.save_every, cfg.run.steps):
                actors.call("save", str(run.checkpoint_path(step)))
                if critic is not None:
                    critic.call("save", str(run.checkpoint_path(step) / "critic"))
                summary["checkpoint"] = str(run.checkpoint_path(step))
            progress.update(1)
            progress.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics.get('train/accuracy', 0):.2f}"
            )
            summary.update({"steps": step, "final_metrics": metrics})
        progress.close()
    finally:
        try:
            rewards.call("close")
        except WorkerError as exc:  # a dead reward worker must not mask the error that ended the run
            log.warning("closing reward workers failed: %s", exc)
        for group in (actors, rewards, reward_models, critic):
            if group is not None:
                group.shutdown()
        dock.shutdown()
    summary["eval_accuracy"] = summary.get("final_metrics", {}).get("eval/accuracy")
    run.write_summary(summary)
    return summary


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


def _start_workers(cfg: TrainConfig, dock) -> tuple[WorkerGroup, WorkerGroup]:
    # PPO's actor does not update during the critic's warm-up steps.
    rl_steps = max(1, cfg.run.steps - cfg.algo.critic_warmup_steps)
    num_actor_ranks = cfg.actor.dp * cfg.actor.tp
    actors = _group(
        cfg.run,
        ActorWorker,
        num_actor_ranks,
        "actor",
        gpu=True,
        distributed=True,
        cfg=cfg,
        client=dock.client(),
        total_optimizer_steps=rl_steps * cfg.actor.mini_batches * cfg.actor.epochs,
        num_threads=_threads_per_rank(cfg, num_actor_ranks),
    )
    rewards = _group(
        cfg.run,
        RewardWorker,
        cfg.reward.num_workers,
        "reward",
        gpu=False,
        reward=cfg.reward,
        algo=cfg.algo,
        tokenizer_path=cfg.model.path,
        client=dock.client(),
        group_size=cfg.rollout.samples_per_prompt,
        log_samples=cfg.run.log_samples,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    return actors, rewards


def _start_reward_models(cfg: TrainConfig, dock) -> WorkerGroup | None:
    """RewardModelWorkers when reward.model.path is set (one GPU each on cuda), else None."""
    if cfg.reward.model.path is None:
        return None
    return _group(
        cfg.run,
        RewardModelWorker,
        cfg.reward.model.num_workers,
        "reward_model",
        gpu=True,
        model=cfg.reward.model,
        policy_path=cfg.model.path,
        client=dock.client(),
        group_size=cfg.rollout.samples_per_prompt,
        groups_per_pull=cfg.reward.groups_per_pull,
        device=cfg.run.device,
        precision=cfg.run.precision,
    )


def _start_critic(cfg: TrainConfig, dock) -> WorkerGroup | None:
    """PPO's CriticWorkers (critic.dp ranks in their own process group; one GPU each on cuda), else None."""
    if cfg.algo.name != "ppo":
        return None
    critic = cfg.critic
    return _group(
        cfg.run,
        CriticWorker,
        critic.dp,
        "critic",
        gpu=True,
        distributed=True,
        cfg=cfg,
        client=dock.client(),
        total_optimizer_steps=cfg.run.steps * critic.mini_batches * critic.epochs,
        num_threads=_threads_per_rank(cfg, critic.dp),
    )


def _group(
    run: RunConfig, worker: type, size: int, name: str, *, gpu: bool, distributed: bool = False, **init
):
    """`size` Ray actors of `worker` (constructed with `init`) that reserve no CPU, and one GPU each when
    `gpu` and run.device=cuda; `distributed` joins them in one process group on run.device."""
    return WorkerGroup(
        worker,
        size,
        name=name,
        distributed=distributed,
        device=run.device,
        num_gpus=1 if gpu and run.device == "cuda" else 0,
        num_cpus=0,
        timeout_s=run.worker_timeout_s,
        init_kwargs=init,
    )


def _threads_per_rank(cfg: TrainConfig, ranks: int) -> int | None:
    """CPU runs split the machine's cores over the ranks; on cuda torch keeps its default."""
    return None if cfg.run.device == "cuda" else max(1, (os.cpu_count() or 1) // ranks)


def _step(
    cfg: TrainConfig,
    step: int,
    sampler: EpochSampler,
    client,
    actors: WorkerGroup,
    rewards: WorkerGroup,
    reward_models: WorkerGroup | None = None,
    critic: WorkerGroup | None = None,
):
    """One RL step; returns (metrics, samples)."""
    timer = StageTimer()
    with timer("step"):
        batch: list[EncodedPrompt] = sampler.next_batch()
        dapo: dict[str, float] = {}
        if cfg.algo.dynamic_sampling:
            batch, gen, scored, dapo = _sample_until_full(
                cfg, step, batch, sampler, client, actors, rewards, reward_models, timer
            )
            value_refs = None  # dynamic sampling is for group-baseline algorithms, never ppo
        else:
            gen, scored, value_refs = _round(
                cfg, step, batch, client, actors, rewards, reward_models, timer, critic
            )
        if cfg.algo.kl_coef > 0:
            with timer("reference"):
                actors.call("compute_ref")
        if not (cfg.actor.mini_batches == 1 and cfg.actor.epochs == 1) or cfg.algo.kl_in_reward:
            with timer("old_logprobs"):
                actors.call("compute_old")
        critic_out: list[dict[str, float]] = []
        if critic is not None:
            with timer("critic_values"):  # what is left of it: it overlaps the log-prob stages
                critic.wait(value_refs, "compute_values")
        with timer("update"):
            # With ppo the actor's update waits in the dock for the critic's advantages, and the critic never
            # waits for the actor: so wait for the critic first, and its failure is reported at once rather
            # than as the actor's dock timeout.
            critic_refs = critic.call_async("update") if critic is not None else None
            train_actor = step > cfg.algo.critic_warmup_steps
            actor_refs = actors.call_async("update") if train_actor else None
            if critic is not None:
                critic_out = critic.wait(critic_refs, "update")
            updates = actors.wait(actor_refs, "update") if train_actor else []
        dock_stats = client.stats()
        client.reset()
    metrics = _metrics(cfg, step, batch, gen, scored, updates, timer, dock_stats)
    metrics.update(dapo)
    metrics.update(critic_out[0] if critic_out else {})  # already all-reduced across critic ranks
    return metrics, _samples(scored)


def _round(cfg, step, batch, client, actors, rewards, reward_models, timer: StageTimer, critic=None):
    """Add `batch`'s groups, generate and score them (overlapped through the dock); returns (per-actor
    generate results, per-reward-worker score results, the critic's compute_values refs or None)."""
    n = cfg.rollout.samples_per_prompt
    client.add_groups([torch.tensor(p.ids) for p in batch], [p.label for p in batch], n)
    start = time.perf_counter()
    gen_refs, reward_refs = actors.call_async("generate", step), rewards.call_async("score")
    rm_refs = reward_models.call_async("score") if reward_models is not None else None
    gen = actors.wait(gen_refs, "generate")
    timer.add("rollout", time.perf_counter() - start)
    value_refs = critic.call_async("compute_values") if critic is not None else None
    if reward_models is not None:  # the reward workers wait for rm_score, so this ends first
        reward_models.wait(rm_refs, "score")
        timer.add("reward_model", time.perf_counter() - start)  # overlaps rollout too
    scored = rewards.wait(reward_refs, "score")
    timer.add("reward", time.perf_counter() - start)  # overlaps rollout; ends when the last group is scored
    return gen, scored, value_refs


def _sample_until_full(cfg, step, batch, sampler, client, actors, rewards, reward_models, timer):
    """DAPO dynamic sampling (recipes/dynamic_sampling.py): rounds of generate + score until
    prompts_per_step groups have reward spread; drops the other groups from the dock. Returns (every
    prompt generated this step, generate results, score results, dapo/* metrics)."""
    n, target = cfg.rollout.samples_per_prompt, cfg.run.prompts_per_step
    prompts, gen, scored = list(batch), [], []
    for rounds in range(1, cfg.algo.max_sampling_rounds + 1):
        round_gen, round_scored, _ = _round(cfg, step, batch, client, actors, rewards, reward_models, timer)
        gen, scored = gen + round_gen, scored + round_scored
        groups = group_rewards(
            [r for s in scored for r in s["rows"]], [x for s in scored for x in s["rewards"]], n
        )
        missing = target - select_groups(groups, target, fill=False).informative
        if missing <= 0 or rounds == cfg.algo.max_sampling_rounds:
            break
        batch = sampler.next_batch(missing)
        prompts += batch
    selection = select_groups(groups, target, fill=True)
    if selection.drop:
        client.drop([first + i for first in selection.drop for i in range(n)])
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


def _metrics(cfg, step, batch, gen, scored, updates, timer: StageTimer, dock_stats) -> dict[str, float]:
    n = cfg.rollout.samples_per_prompt
    lengths = [x for g in gen for x in g["response_lengths"]]
    rewards = [x for s in scored for x in s["rewards"]]
    correct = [x for s in scored for x in s["correct"]]
    prompt_tokens = sum(len(p.ids) for p in batch) * n
    response_tokens = sum(lengths)
    m: dict[str, float] = {}
    m.update(describe([float(r) for r in rewards], "reward"))
    m.update(describe([float(x) for x in lengths], "response_length"))
    m["response_length/truncated_frac"] = sum(g["truncated"] for g in gen) / max(1, len(lengths))
    if correct:
        m["train/accuracy"] = statistics.fmean(correct)
    overlong = [x for s in scored for x in s.get("overlong", [])]
    rm = [x for s in scored for x in s.get("rm", [])]
    if rm:  # raw reward-model scores; reward/mean includes reward.model.weight x these
        m["reward/rm"] = statistics.fmean(rm)
    if overlong:  # DAPO overlong shaping: mean penalty (<= 0) and share of rows penalised
        m["reward/overlong_penalty"] = statistics.fmean(overlong)
        m["reward/overlong_frac"] = sum(x < 0 for x in overlong) / len(overlong)
    m["reward/timeouts"] = float(sum(s["timeouts"] for s in scored))
    m["reward/errors"] = float(sum(s["errors"] for s in scored))
    for key in updates[0] if updates else ():  # no actor update during ppo's critic warm-up
        m[f"actor/{key}"] = updates[0][key]  # already all-reduced across ranks
    m.update(timer.metrics())
    m["timing/reshard_to_rollout"] = max(g["reshard_s"] for g in gen)  # inside timing/rollout
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
    m["tokens/prompt"] = float(prompt_tokens)
    m["tokens/response"] = float(response_tokens)
    return m


def _samples(scored: list[dict]) -> list[dict]:
    return [s for worker in scored for s in worker["samples"]]


def _evaluate(
    cfg: TrainConfig, actors: WorkerGroup, prompts: list[EncodedPrompt], tokenizer: Tokenizer
) -> dict:
    """Greedy answers from the current policy (prompts split over the actor ranks), scored in the driver."""
    # One shard per rollout replica, given to its head rank (tp peers get theirs by broadcast, answer []).
    tp, replicas = cfg.rollout.tp, len(actors) // cfg.rollout.tp
    shards = [prompts[r // tp :: replicas] if r % tp == 0 else [] for r in range(len(actors))]
    outs = actors.call_ranks("evaluate", [([p.ids for p in s], cfg.rollout.max_new_tokens) for s in shards])
    ordered_prompts = [p for s in shards for p in s]
    responses = [tokenizer.decode(ids) for o in outs for ids in o]
    scored = score_answers(
        ordered_prompts, responses, reward_specs(cfg.reward), timeout_s=cfg.reward.timeout_s
    )
    return {"eval/accuracy": scored["accuracy"], "eval/reward_mean": scored["reward_mean"]}


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _progress(cfg: TrainConfig):
    from tqdm.auto import tqdm

    return tqdm(
        total=cfg.run.steps, desc="grpo", unit="step", disable=not cfg.run.progress, dynamic_ncols=True
    )
