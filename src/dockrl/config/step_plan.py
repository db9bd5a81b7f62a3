"""The step plan: what one RL step runs and where each quantity is computed, resolved once from the config.

An algorithm name (`algo.name`) is a preset of orthogonal settings (algos/registry.py); this module is the only
place that resolves it. What the estimator implies comes from its registered traits, never its name. The recipe
and every worker receive the plan when they are built instead of re-deriving conditions from the config:

    reference        the reference model is loaded and `ref_logprobs` computed (algo.kl_coef > 0; None: the algorithm's own)
    old_logprobs     `old_logprobs` computed before the update (off-policy updates, or PPO's KL in the reward)
    estimator        the advantage estimator (algo.adv_estimator, else the algorithm's own)
    advantages_by    who computes advantages: the RewardWorker (group estimators) or the critic (GAE)
    whiten           the actor whitens advantages over every token of the step (REINFORCE++, PPO)
    critic           PPO's CriticWorkers run (the gae estimator needs their values)
    kl_coef          the KL coefficient (in the loss, or the initial one of the penalty in the reward)
    rollout_lead     steps the rollout runs ahead of the update
    schedule         the step schedule: sync, async (k steps ahead) or partial, and dynamic-sampling rounds
    lora             actor.lora resolved (rank, alpha, dropout, targets), or None for full fine-tuning
    loss             the policy loss (algos/registry.py LossPlan): aggregation, clip range, where the KL goes,
                     the ratio level (token or sequence), the loss normaliser and top-k distillation's weight
    distill_top_k    distill.top_k: the update reads the teacher's top-k columns (0: none, or no teacher)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dockrl.algos.registry import PRESETS, Estimator, LossAgg, LossPlan, estimator_named
from dockrl.config.budgets import policy_budget
from dockrl.config.lora_checks import LoraSettings, check_lora
from dockrl.config.schedule import Schedule, schedule_of
from dockrl.config.schema import AlgoConfig, DistillConfig, TrainConfig

__all__ = [
    "LossPlan",
    "StepPlan",
    "estimator_of",
    "loss_plan",
    "resolved_clip",
    "resolved_kl_coef",
    "resolved_loss_agg",
    "resolved_loss_normalizer",
    "resolved_ratio_level",
    "rollout_lead",
    "step_plan",
    "traits_of",
]


@dataclass(frozen=True)
class StepPlan:
    """The stages of one RL step and where each quantity is computed (see the module docstring)."""

    reference: bool
    old_logprobs: bool  # the old log-prob stage runs (a forward pass before the update)
    old_from_rollout: (
        bool  # an off-policy update takes its old log-probs from the rollout (algo.old_logprobs)
    )
    on_policy: bool  # one update per step (single_update) on rows the current weights sampled
    single_update: (
        bool  # one optimizer step per RL step: the old policy is the current one (old = logp.detach())
    )
    estimator: str
    advantages_by: Literal["reward", "critic"]
    whiten: bool
    critic: bool
    critic_warmup_steps: int
    kl_in_reward: bool
    kl_coef: float  # algo.kl_coef, else the algorithm's own
    rollout_lead: int  # see rollout_lead()
    loss: LossPlan
    schedule: Schedule  # which step schedule runs (sync, async k, partial; dynamic-sampling rounds)
    lora: LoraSettings | None = None  # actor.lora resolved; None: full fine-tuning
    multi_turn: bool = False  # env.name: trajectories carry a loss_mask (observation tokens train on nothing)
    # LoRA from model.lora_path with algo.kl_reference=adapter: the KL reference is the policy with the starting
    # adapter's values (kept beside the trained ones), not its base
    reference_adapters: bool = False
    distill_top_k: int = (
        0  # distill.top_k of a run with a teacher: the update reads the teacher's top-k columns
    )

    @property
    def reference_in_policy(self) -> bool:
        """LoRA: the KL reference is the policy's own base, with its adapters off or at their starting values
        (no second model is loaded)."""
        return self.lora is not None

    @property
    def reference_is_base(self) -> bool:
        """LoRA: the KL reference is the policy with its adapters off."""
        return self.lora is not None and not self.reference_adapters

    @property
    def actor_shapes_kl(self) -> bool:
        """REINFORCE++ with the KL in the reward: the actor subtracts the KL to go from the advantages before
        whitening (PPO's critic puts the KL in its own token rewards instead)."""
        return self.kl_in_reward and self.advantages_by == "reward"

    def trains_actor(self, step: int) -> bool:
        """Whether the actor updates at `step` (not during PPO's critic warm-up)."""
        return step > self.critic_warmup_steps


def resolved_clip(algo: AlgoConfig) -> tuple[float, float]:
    """(clip_low, clip_high): the explicit values, else the algorithm's own."""
    preset = PRESETS[algo.name]
    low = preset.clip_low if algo.clip_low is None else algo.clip_low
    return low, preset.clip_high if algo.clip_high is None else algo.clip_high


def resolved_kl_coef(algo: AlgoConfig) -> float:
    """algo.kl_coef, else the algorithm's own (config.resolve writes it into the resolved config)."""
    return PRESETS[algo.name].kl_coef if algo.kl_coef is None else algo.kl_coef


def resolved_loss_agg(algo: AlgoConfig) -> LossAgg:
    """algo.loss_agg, else the algorithm's own."""
    return PRESETS[algo.name].loss_agg if algo.loss_agg is None else algo.loss_agg


def resolved_ratio_level(algo: AlgoConfig) -> str:
    """algo.ratio_level, else the algorithm's own."""
    return PRESETS[algo.name].ratio_level if algo.ratio_level is None else algo.ratio_level


def resolved_loss_normalizer(algo: AlgoConfig) -> str:
    """algo.loss_normalizer, else the algorithm's own."""
    return PRESETS[algo.name].loss_normalizer if algo.loss_normalizer is None else algo.loss_normalizer


def estimator_of(algo: AlgoConfig) -> str:
    """The advantage estimator: algo.adv_estimator, else the algorithm's preset."""
    return algo.adv_estimator or PRESETS[algo.name].estimator


def traits_of(algo: AlgoConfig) -> Estimator:
    """The registered estimator `estimator_of(algo)` names, with its traits (a registered name: the loader and
    config.algo_checks refuse any other)."""
    return estimator_named(estimator_of(algo))


def loss_plan(
    algo: AlgoConfig, max_new_tokens: int | None = None, distill: DistillConfig | None = None
) -> LossPlan:
    """The policy loss of `algo`; `max_new_tokens` (rollout.max_new_tokens) is the constant normaliser of
    algo.loss_normalizer=max_new_tokens (Dr. GRPO's), required with it; `distill` (a run with a teacher):
    distill.top_k > 0 puts distill.coef x the top-k KL in the loss."""
    normalizer = resolved_loss_normalizer(algo)
    seq_len_norm = None
    if normalizer == "max_new_tokens":
        if max_new_tokens is None:
            raise ValueError(
                f"algo.name={algo.name} normalises the loss by max_new_tokens (algo.loss_normalizer); pass "
                "rollout.max_new_tokens"
            )
        seq_len_norm = float(max_new_tokens)
    clip_low, clip_high = resolved_clip(algo)
    return LossPlan(
        agg=resolved_loss_agg(algo),
        clip_low=clip_low,
        clip_high=clip_high,
        kl_coef=0.0 if algo.kl_in_reward else resolved_kl_coef(algo),
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
        sequence_ratio=resolved_ratio_level(algo) == "sequence",
        seq_len_norm=seq_len_norm,
        rollout_is=algo.rollout_is,
        rollout_is_cap=algo.rollout_is_cap,
        distill_coef=distill.coef if distill is not None and distill.top_k > 0 else 0.0,
    )


def _sampled_budget(cfg: TrainConfig) -> int:
    """The most tokens the policy samples for a row: rollout.max_new_tokens, or a multi-turn trajectory's policy
    budget (config/budgets.py): Dr. GRPO's constant normaliser."""
    if cfg.env.name is None:
        return cfg.rollout.max_new_tokens
    return policy_budget(cfg.env, cfg.rollout.max_new_tokens)


def rollout_lead(cfg: TrainConfig) -> int:
    """Steps the rollout runs ahead of the update: rollout.max_staleness, or 0 with rollout.partial (whose
    staleness budget goes to the cuts of carried responses instead)."""
    return 0 if cfg.rollout.partial else cfg.rollout.max_staleness


def step_plan(cfg: TrainConfig) -> StepPlan:
    """Resolve `cfg` (checked by config.validate.check_train) into its step plan (pure: reads nothing else)."""
    algo, actor = cfg.algo, cfg.actor
    estimator = traits_of(algo)
    # One optimizer step per RL step: the policy before the update is the current one, so its log-probs are
    # the update's own (detached) and an old log-prob pass would compute the same numbers again. On-policy
    # besides: the current weights also sampled the rows.
    single_update = actor.mini_batches == 1 and actor.epochs == 1
    on_policy = single_update and cfg.rollout.max_staleness == 0
    from_rollout = not on_policy and algo.old_logprobs == "rollout"
    return StepPlan(
        reference=resolved_kl_coef(algo) > 0,
        old_logprobs=(not single_update and not from_rollout) or algo.kl_in_reward,
        old_from_rollout=from_rollout,
        on_policy=on_policy,
        single_update=single_update,
        estimator=estimator.name,
        advantages_by="critic" if estimator.needs_critic else "reward",
        whiten=estimator.whitened,
        critic=estimator.needs_critic,
        critic_warmup_steps=algo.critic_warmup_steps,
        kl_in_reward=algo.kl_in_reward,
        kl_coef=resolved_kl_coef(algo),
        rollout_lead=rollout_lead(cfg),
        loss=loss_plan(algo, _sampled_budget(cfg), cfg.distill if cfg.distill.teacher_path else None),
        schedule=schedule_of(cfg),
        lora=check_lora(actor.lora, has_critic=estimator.needs_critic),
        multi_turn=cfg.env.name is not None,
        reference_adapters=actor.lora.rank > 0
        and cfg.model.lora_path is not None
        and algo.kl_reference == "adapter",
        distill_top_k=cfg.distill.top_k if cfg.distill.teacher_path is not None else 0,
    )
