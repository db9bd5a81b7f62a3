"""What each worker is built with: one frozen spec per component, cut from the resolved config.

```
 TrainConfig (checked, resolved) ──specs(cfg, plan)──▶ Specs(actor, rollout, reward, reward_model?, critic?,
                                                            teacher?)
     recipes/cluster.py hands each worker group its spec (and the step plan, a dock client), nothing else: the
     config stops there
 ActorSpec        the policy's model paths, optimizer and layout (actor.*), the algorithm, the switch, its
                  RolloutSpec
 RolloutSpec      the backend and its settings, sampling, budgets, the per-row seed, precision, bucket size,
                  partial rollout, the environment (EnvSpec) or None: what an actor rank or a replica generates with
 RewardStageSpec  the reward stage (reward.*) and what its terms depend on: estimator, env weight, teacher, budget
 RewardModelSpec, CriticSpec, TeacherSpec
```

Specs are plain frozen dataclasses (config sections inside them are read, never changed): engines and workers
see typed fields, not `Any`. No torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dockrl.config.budgets import policy_budget, trajectory_budget
from dockrl.config.schema import (
    ActorConfig,
    AlgoConfig,
    CriticConfig,
    DistillConfig,
    EnvConfig,
    ReshardConfig,
    RewardConfig,
    RewardModelConfig,
    TrainConfig,
)
from dockrl.config.step_plan import StepPlan


@dataclass(frozen=True)
class Partial:
    """Partial rollout's budget: `tokens` new tokens per response per pass, at most `max_cuts` cuts per row
    (its pass after the last cut runs to `max_new_tokens`)."""

    tokens: int
    max_cuts: int
    max_new_tokens: int

    def budget(self, done: int, cuts: int) -> int:
        """New tokens allowed this pass to a row with `done` tokens cut `cuts` times so far."""
        rest = self.max_new_tokens - done
        return rest if cuts >= self.max_cuts else min(self.tokens, rest)


@dataclass(frozen=True)
class EnvSpec:
    """A multi-turn run's environment (env.*) and the chat's system prompt (data.system_prompt)."""

    name: str
    kwargs: dict
    code: str | None  # the environment file's source, shipped to every node
    origin: str | None  # that file's path
    max_turns: int
    max_tool_calls: int
    max_response_tokens: int  # the trajectory budget (config/budgets.py)
    policy_budget: int  # the most tokens the policy samples in a trajectory
    call_timeout_s: float
    num_workers: int  # environment worker processes
    concurrency: int  # calls at once per worker
    reward_weight: float
    system_prompt: str | None
    allow_unsandboxed: bool = False  # env.allow_unsandboxed


@dataclass(frozen=True)
class RolloutSpec:
    """How a run generates, on an actor rank or a separate replica (rollout.*, and what it depends on)."""

    model_path: str
    backend: str  # a name of backends.BACKENDS
    backend_settings: Any  # its section (rollout.<backend>.*), None when it has none
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    stop_strings: tuple[str, ...]
    samples_per_prompt: int
    groups_per_pull: int
    # Rows a replica holds at once: its even share of a step's groups (ceil(prompts_per_step / replicas) x
    # samples_per_prompt), so on a small step the first replica to pull does not take every group while the
    # others idle (16 rows on 2 ranks: one rank decoded all 16, the other none).
    share_rows: int
    max_batch_size: int
    kv_cache: str  # auto | slots | paged
    kv_cache_tokens: int  # 0: max_batch_size x max_seq_len
    keep_kv_across_turns: bool
    pack_weights: bool
    native_kernels: bool
    max_prompt_len: int
    tp: int
    seed: int
    device: str  # "cpu" or "cuda"
    precision: str  # "fp32" or "bf16"
    bucket_bytes: int | None  # the switch's and the replicas' gather buffers; None: the largest tensor
    free_kv_cache: bool  # after each rollout (reshard.free_kv_cache resolved for the device)
    worker_timeout_s: float
    partial: Partial | None
    env: EnvSpec | None  # None: single-turn

    @property
    def response_budget(self) -> int:
        """Tokens after the prompt a response may take: rollout.max_new_tokens, or a multi-turn trajectory's
        budget (config/budgets.py)."""
        return self.max_new_tokens if self.env is None else self.env.max_response_tokens

    @property
    def max_seq_len(self) -> int:
        """Positions a sequence may need: the longest prompt and the response budget (before the model's own
        limit)."""
        return self.max_prompt_len + self.response_budget


@dataclass(frozen=True)
class ActorSpec:
    """The colocated actor's ranks: the policy and its reference, how they train, and how they generate."""

    model_path: str
    ref_path: str | None
    lora_path: str | None
    optim: ActorConfig  # actor.*: optimizer, micro-batches, layout (dp, tp, ep)
    algo: AlgoConfig
    reshard: ReshardConfig
    rollout: RolloutSpec
    rows_per_step: int
    total_optimizer_steps: int


@dataclass(frozen=True)
class RewardStageSpec:
    """The RewardWorkers: reward.* and what the reward terms depend on (rewards/terms.py)."""

    reward: RewardConfig
    algo: AlgoConfig
    estimator: (
        str | None
    )  # the group estimator when the reward stage computes advantages, None: the critic does
    tokenizer_path: str  # the policy's model directory: responses are decoded with its tokenizer
    group_size: int  # rollout.samples_per_prompt
    log_samples: int = 0  # run.log_samples
    max_new_tokens: int | None = (
        None  # the overlong-shaping limit: rollout.max_new_tokens, or the policy budget
    )
    # of a multi-turn trajectory (config/budgets.py), whose sampled tokens (loss_mask) count against it
    env_weight: float | None = None  # env.reward_weight of a multi-turn run, None: single-turn
    distill_coef: float | None = None  # distill.coef of a sampled-token teacher (distill.top_k 0), else None


@dataclass(frozen=True)
class RewardModelSpec:
    """The RewardModelWorkers (reward.model.*)."""

    reward_model: RewardModelConfig
    policy_path: str  # its tokenizer decodes the rows when the reward model reads another vocabulary
    group_size: int
    groups_per_pull: int
    device: str
    precision: str


@dataclass(frozen=True)
class CriticSpec:
    """PPO's critic ranks."""

    path: str  # critic.path resolved (the policy's model when unset)
    tokenizer_path: str  # the policy's model directory (its tokenizer goes with the critic's export)
    optim: CriticConfig
    algo: AlgoConfig
    precision: str
    seed: int
    rows_per_step: int
    samples_per_prompt: int
    total_optimizer_steps: int


@dataclass(frozen=True)
class TeacherSpec:
    """On-policy distillation's teacher ranks."""

    policy_path: str
    distill: DistillConfig
    precision: str
    temperature: float
    samples_per_prompt: int
    groups_per_pull: int
    multi_turn: bool


@dataclass(frozen=True)
class Specs:
    """Every component's spec of one run (critic and teacher: None when the run has none)."""

    actor: ActorSpec
    rollout: RolloutSpec
    reward: RewardStageSpec
    reward_model: RewardModelSpec | None
    critic: CriticSpec | None
    teacher: TeacherSpec | None


def specs(cfg: TrainConfig, plan: StepPlan) -> Specs:
    """The specs of a resolved config (config.resolve) and its step plan; pure."""
    rollout = rollout_spec(cfg)
    rows = cfg.run.prompts_per_step * cfg.rollout.samples_per_prompt
    rl_steps = max(1, cfg.run.steps - cfg.algo.critic_warmup_steps)  # PPO's actor waits for the critic
    actor = ActorSpec(
        model_path=cfg.model.path,
        ref_path=cfg.model.ref_path,
        lora_path=cfg.model.lora_path,
        optim=cfg.actor,
        algo=cfg.algo,
        reshard=cfg.reshard,
        rollout=rollout,
        rows_per_step=rows,
        total_optimizer_steps=rl_steps * cfg.actor.mini_batches * cfg.actor.epochs,
    )
    critic = None
    if plan.critic:
        critic = CriticSpec(
            path=cfg.critic.path or cfg.model.path,
            tokenizer_path=cfg.model.path,
            optim=cfg.critic,
            algo=cfg.algo,
            precision=cfg.run.precision,
            seed=cfg.run.seed,
            rows_per_step=rows,
            samples_per_prompt=cfg.rollout.samples_per_prompt,
            total_optimizer_steps=cfg.run.steps * cfg.critic.mini_batches * cfg.critic.epochs,
        )
    teacher = None
    if cfg.distill.teacher_path is not None:
        teacher = TeacherSpec(
            policy_path=cfg.model.path,
            distill=cfg.distill,
            precision=cfg.run.precision,
            temperature=cfg.rollout.temperature,
            samples_per_prompt=cfg.rollout.samples_per_prompt,
            groups_per_pull=cfg.reward.groups_per_pull,
            multi_turn=cfg.env.name is not None,
        )
    reward = RewardStageSpec(
        reward=cfg.reward,
        algo=cfg.algo,
        estimator=plan.estimator if plan.advantages_by == "reward" else None,
        tokenizer_path=cfg.model.path,
        group_size=cfg.rollout.samples_per_prompt,
        log_samples=cfg.run.log_samples,
        max_new_tokens=rollout.max_new_tokens if rollout.env is None else rollout.env.policy_budget,
        env_weight=cfg.env.reward_weight if cfg.env.name is not None else None,
        # the sampled-token form's term of the advantages (the top-k form is a term of the actor's loss)
        distill_coef=cfg.distill.coef
        if cfg.distill.teacher_path is not None and not cfg.distill.top_k
        else None,
    )
    reward_model = None
    if cfg.reward.model.path is not None:
        reward_model = RewardModelSpec(
            reward_model=cfg.reward.model,
            policy_path=cfg.model.path,
            group_size=cfg.rollout.samples_per_prompt,
            groups_per_pull=cfg.reward.groups_per_pull,
            device=cfg.run.device,
            precision=cfg.run.precision,
        )
    return Specs(
        actor=actor, rollout=rollout, reward=reward, reward_model=reward_model, critic=critic, teacher=teacher
    )


def rollout_replicas(cfg: TrainConfig) -> int:
    """Engines that pull a step's rows from the dock: the actor's ranks in groups of rollout.tp (colocated), or
    rollout.replicas (separate)."""
    if cfg.rollout.placement == "separate":
        return cfg.rollout.replicas
    return max(1, cfg.actor.dp * cfg.actor.cp * cfg.actor.tp // cfg.rollout.tp)


def rollout_spec(cfg: TrainConfig) -> RolloutSpec:
    """The RolloutSpec of a resolved config."""
    roll, reshard = cfg.rollout, cfg.reshard
    partial = None
    if roll.partial:
        tokens = roll.partial_tokens or max(1, roll.max_new_tokens // 4)
        partial = Partial(tokens, roll.max_staleness, roll.max_new_tokens)
    free_kv = reshard.free_kv_cache if reshard.free_kv_cache is not None else cfg.run.device == "cuda"
    return RolloutSpec(
        model_path=cfg.model.path,
        backend=roll.backend,
        backend_settings=getattr(roll, roll.backend, None),
        max_new_tokens=roll.max_new_tokens,
        temperature=roll.temperature,
        top_p=roll.top_p,
        top_k=roll.top_k,
        min_p=roll.min_p,
        stop_strings=tuple(roll.stop_strings),
        samples_per_prompt=roll.samples_per_prompt,
        groups_per_pull=roll.groups_per_pull,
        share_rows=-(-cfg.run.prompts_per_step // rollout_replicas(cfg)) * roll.samples_per_prompt,
        max_batch_size=roll.max_batch_size,
        kv_cache=roll.kv_cache,
        kv_cache_tokens=roll.kv_cache_tokens,
        keep_kv_across_turns=roll.keep_kv_across_turns,
        pack_weights=roll.pack_weights,
        native_kernels=roll.native_kernels,
        max_prompt_len=cfg.data.max_prompt_len,
        tp=roll.tp,
        seed=cfg.run.seed,
        device=cfg.run.device,
        precision=cfg.run.precision,
        bucket_bytes=None if reshard.bucket_mb is None else int(reshard.bucket_mb * 2**20),
        free_kv_cache=free_kv,
        worker_timeout_s=cfg.run.worker_timeout_s,
        partial=partial,
        env=env_spec(cfg.env, cfg.data.system_prompt, roll.max_new_tokens),
    )


def env_spec(env: EnvConfig, system_prompt: str | None, max_new_tokens: int) -> EnvSpec | None:
    """The EnvSpec of env.* with the chat's system prompt when env.name is set (multi-turn), else None; its
    budgets resolved for turns of `max_new_tokens` (rollout.max_new_tokens; config/budgets.py)."""
    if env.name is None:
        return None
    return EnvSpec(
        name=env.name,
        kwargs=dict(env.kwargs),
        code=env.code,
        origin=env.source_file,
        max_turns=env.max_turns,
        max_tool_calls=env.max_tool_calls,
        max_response_tokens=trajectory_budget(env, max_new_tokens),
        policy_budget=policy_budget(env, max_new_tokens),
        call_timeout_s=env.call_timeout_s,
        num_workers=env.num_workers,
        concurrency=env.concurrency,
        reward_weight=env.reward_weight,
        system_prompt=system_prompt,
        allow_unsandboxed=env.allow_unsandboxed,
    )
