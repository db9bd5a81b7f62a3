"""Checks of the RL objective (algo.*, and PPO's critic): the algorithm's presets, its loss settings and what
dynamic sampling needs. Pure rules, called by `check_train` before any process starts; settings without effect
in a combination warn. What an advantage estimator allows is read from its registered traits
(algos/registry.py), never from its name.
"""

from __future__ import annotations

import warnings

from dockrl.algos.registry import (
    KL_CONTROLLERS,
    LOSS_NORMALIZERS,
    PRESETS,
    RATIO_LEVELS,
    Estimator,
    estimator_named,
    estimators,
)
from dockrl.config.checks import positive
from dockrl.config.fields import config_error
from dockrl.config.schema import AlgoConfig, CriticConfig, TrainConfig
from dockrl.config.step_plan import (
    estimator_of,
    resolved_clip,
    resolved_kl_coef,
    resolved_loss_agg,
    traits_of,
)


def own_estimator(algo: AlgoConfig) -> Estimator:
    """The estimator of the algorithm's preset (what algo.adv_estimator overrides)."""
    return estimator_named(PRESETS[algo.name].estimator)


def runs_critic(algo: AlgoConfig) -> bool:
    """Whether the algorithm's estimator takes a critic's values (ppo's gae)."""
    return traits_of(algo).needs_critic


def check_dynamic_sampling(cfg: TrainConfig) -> None:
    """algo.dynamic_sampling needs groups whose rewards can differ, and a round limit."""
    algo, roll = cfg.algo, cfg.rollout
    if not algo.dynamic_sampling:
        return
    if roll.samples_per_prompt < 2:
        raise config_error(
            "algo.dynamic_sampling",
            True,
            f"drops groups without reward spread, and a group of rollout.samples_per_prompt="
            f"{roll.samples_per_prompt} never has any",
            "use rollout.samples_per_prompt >= 2 (DAPO uses 8-16), or algo.dynamic_sampling=false",
        )
    if runs_critic(algo):
        raise config_error(
            "algo.dynamic_sampling",
            True,
            "filters groups by reward spread, which only group-baseline algorithms need; ppo's critic "
            "gives every sample an advantage",
            "use algo.dynamic_sampling=false with algo.name=ppo",
        )
    if algo.max_sampling_rounds < 1:
        raise config_error("algo.max_sampling_rounds", algo.max_sampling_rounds, "must be >= 1", "use e.g. 3")
    if not cfg.reward.functions:
        raise config_error(
            "algo.dynamic_sampling",
            True,
            "keeps groups whose rule rewards (or <fn>/correct) differ, and reward.functions=[] gives none",
            "add a rule reward function (e.g. exact_answer), or use algo.dynamic_sampling=false",
        )


def check_algorithm(cfg: TrainConfig) -> None:
    """algo.name and the settings each algorithm needs, conflicts as errors, no-ops as warnings."""
    algo, roll = cfg.algo, cfg.rollout
    if algo.name not in PRESETS:
        raise config_error("algo.name", algo.name, "unknown algorithm", f"use one of {', '.join(PRESETS)}")
    _check_estimator(algo)
    _check_ppo(cfg)
    min_group_size = PRESETS[algo.name].min_group_size
    if roll.samples_per_prompt < min_group_size:
        raise config_error(
            "rollout.samples_per_prompt",
            roll.samples_per_prompt,
            f"algo.name={algo.name} compares the samples of a group and needs at least {min_group_size}",
            f"set rollout.samples_per_prompt >= {min_group_size} (or use reinforce_pp, which needs no group)",
        )
    if algo.name == "dapo" and resolved_kl_coef(algo) > 0:  # set explicitly: DAPO's own is 0
        raise config_error(
            "algo.kl_coef",
            algo.kl_coef,
            "DAPO trains without a reference model",
            "set algo.kl_coef=0 (or use algo.name=grpo for a KL term)",
        )
    _check_loss_settings(cfg)
    if not traits_of(algo).std_normalized:  # the std normalisation and its epsilon: the grpo estimator's
        default_eps = AlgoConfig.__dataclass_fields__["adv_eps"].default
        std_estimators = ", ".join(name for name, e in estimators().items() if e.std_normalized)
        unused = [f"algo.norm_adv_by_std={algo.norm_adv_by_std}"] if not algo.norm_adv_by_std else []
        unused += [f"algo.adv_eps={algo.adv_eps}"] if algo.adv_eps != default_eps else []
        for setting_text in unused:
            warnings.warn(
                f"{setting_text} has no effect with algo.name={algo.name} (estimator "
                f"{estimator_of(algo)}); it applies to the {std_estimators} estimator",
                stacklevel=3,
            )
    if algo.overlong_buffer_len < 0 or algo.overlong_buffer_len > roll.max_new_tokens:
        raise config_error(
            "algo.overlong_buffer_len",
            algo.overlong_buffer_len,
            f"must be in [0, rollout.max_new_tokens={roll.max_new_tokens}]",
            "use 0 (off) or a buffer shorter than the generation limit",
        )
    positive("algo.overlong_penalty", algo.overlong_penalty, allow_zero=True)


def _check_estimator(algo: AlgoConfig) -> None:
    """algo.adv_estimator is registered, and takes a critic's values exactly when the algorithm runs one."""
    if algo.adv_estimator is None:
        return
    known = estimators()
    if algo.adv_estimator not in known:
        raise config_error(
            "algo.adv_estimator",
            algo.adv_estimator,
            "unknown estimator",
            f"use one of {tuple(known)} or None (the algorithm's own)",
        )
    chosen, own = known[algo.adv_estimator], own_estimator(algo)
    critic_algorithms = [name for name, p in PRESETS.items() if known[p.estimator].needs_critic]
    if chosen.needs_critic and not own.needs_critic:
        raise config_error(
            "algo.adv_estimator",
            chosen.name,
            f"{chosen.name.upper()} needs a critic's values, and only algo.name="
            f"{' or '.join(critic_algorithms)} runs a critic",
            f"set algo.name={critic_algorithms[0]}, or use one of "
            f"{tuple(name for name, e in known.items() if not e.needs_critic)}",
        )
    if own.needs_critic and chosen.name != own.name:
        raise config_error(
            "algo.adv_estimator",
            chosen.name,
            f"algo.name={algo.name} computes {own.name.upper()} advantages from its critic's values",
            "unset algo.adv_estimator (or use another algo.name for group advantages)",
        )


def _check_loss_settings(cfg: TrainConfig) -> None:
    """Warn where the loss settings say something the step will not do, or depart from the paper."""
    algo, actor = cfg.algo, cfg.actor
    clip_low, clip_high = resolved_clip(algo)
    if algo.name == "dapo" and clip_high <= clip_low:
        warnings.warn(
            f"algo.name=dapo with algo.clip_high={clip_high} <= algo.clip_low={clip_low}: no clip-higher; "
            "DAPO uses clip_low=0.2 clip_high=0.28",
            stacklevel=4,
        )
    if algo.name == "gspo" and (algo.clip_low, algo.clip_high) != (None, None):
        preset = PRESETS["gspo"]
        if (clip_low, clip_high) != (preset.clip_low, preset.clip_high):
            warnings.warn(
                f"algo.name=gspo clips the sequence ratio at 1 - {preset.clip_low:g} / 1 + {preset.clip_high:g} "
                f"(the GSPO paper); algo.clip_low={clip_low:g} algo.clip_high={clip_high:g} is off the paper "
                "(a token-level range such as 0.2 lets almost every sequence through unclipped)",
                stacklevel=4,
            )
    wanted_agg = PRESETS[algo.name].loss_agg  # the aggregation of the algorithm's paper
    if algo.name in ("dapo", "dr_grpo", "gspo") and resolved_loss_agg(algo) != wanted_agg:
        warnings.warn(
            f"algo.name={algo.name} is defined with algo.loss_agg={wanted_agg}; got {algo.loss_agg}",
            stacklevel=4,
        )
    _check_ratio_and_normalizer(algo)
    # One update per step clips against the current policy (ratio 1), unless a stale row's old log-probs are
    # the rollout's own (algo.old_logprobs=rollout with rollout.max_staleness > 0): then the clip acts.
    single_update = actor.mini_batches == 1 and actor.epochs == 1
    stale_rollout_old = cfg.rollout.max_staleness > 0 and algo.old_logprobs == "rollout"
    clip_set = algo.clip_low is not None or algo.clip_high is not None or algo.name in ("dapo", "gspo")
    if single_update and not stale_rollout_old and clip_set:
        warnings.warn(
            f"the ratio clip (algo.clip_low={clip_low:g}, algo.clip_high={clip_high:g}) never acts: with "
            "actor.mini_batches=1 and actor.epochs=1 the update is exactly on-policy and every importance ratio "
            "is 1; use actor.mini_batches > 1 or actor.epochs > 1 (DAPO and GSPO update in several mini-batches "
            "per step)",
            stacklevel=4,
        )
    if algo.rollout_is_cap < 1:
        raise config_error(
            "algo.rollout_is_cap",
            algo.rollout_is_cap,
            "must be >= 1 (it caps a weight around 1)",
            "use e.g. 2.0",
        )
    roll = cfg.rollout
    settings = (("top_p", roll.top_p, 1.0), ("top_k", roll.top_k, 0), ("min_p", roll.min_p, 0.0))
    truncating = [f"rollout.{key}={value}" for key, value, off in settings if value != off]
    if truncating:
        warnings.warn(
            f"{', '.join(truncating)}: the rollout samples from a truncated distribution while log-probs (the "
            "trainer's and the rollout's) are over the full vocabulary, so the update's importance ratio is "
            "biased; algo.rollout_is=tis corrects part of it, or sample untruncated",
            stacklevel=4,
        )
    if algo.kl_estimator == "k1" and resolved_kl_coef(algo) > 0 and not algo.kl_in_reward:
        warnings.warn(
            "algo.kl_estimator=k1 in the loss has zero expected gradient (its gradient is pure noise around 0): "
            "use k3 (or k2) for a KL term in the loss; k1 is meant for a KL penalty in the reward "
            "(algo.kl_in_reward)",
            stacklevel=4,
        )


def _check_ratio_and_normalizer(algo: AlgoConfig) -> None:
    """algo.ratio_level and algo.loss_normalizer: known values; the normaliser acts on seq-mean-token-sum only."""
    for key, value, choices in (
        ("algo.ratio_level", algo.ratio_level, RATIO_LEVELS),
        ("algo.loss_normalizer", algo.loss_normalizer, LOSS_NORMALIZERS),
    ):
        if value is not None and value not in choices:
            raise config_error(
                key, value, "unknown choice", f"use one of {choices} (or None: the algorithm's own)"
            )
    agg = resolved_loss_agg(algo)
    # set explicitly (a preset's own normaliser under another aggregation is the loss_agg warning's concern)
    if algo.loss_normalizer == "max_new_tokens" and agg != "seq-mean-token-sum":
        warnings.warn(
            f"algo.loss_normalizer=max_new_tokens has no effect with algo.loss_agg={agg}: it divides the token "
            "sums of seq-mean-token-sum (the other aggregations divide by token counts)",
            stacklevel=5,
        )


def _check_ppo(cfg: TrainConfig) -> None:
    """The KL-in-reward settings, and the critic's: only PPO has token rewards and a critic."""
    algo, critic = cfg.algo, cfg.critic
    if algo.kl_ctrl not in KL_CONTROLLERS:
        raise config_error(
            "algo.kl_ctrl", algo.kl_ctrl, "unknown KL controller", f"use one of {KL_CONTROLLERS}"
        )
    if algo.kl_in_reward and not traits_of(algo).kl_in_reward:
        raise config_error(
            "algo.kl_in_reward",
            True,
            "the KL penalty goes into per-token rewards, which only PPO's GAE and REINFORCE++'s returns use "
            f"(algo.name={algo.name}, estimator {estimator_of(algo)})",
            "set algo.name=ppo, reinforce_pp or reinforce_pp_baseline, or algo.kl_in_reward=false for the KL "
            "term in the loss",
        )
    if algo.kl_ctrl == "adaptive" and not runs_critic(algo):
        raise config_error(
            "algo.kl_ctrl",
            "adaptive",
            f"the adaptive KL controller lives in PPO's critic; algo.name={algo.name} has none",
            "use algo.kl_ctrl=fixed, or algo.name=ppo",
        )
    if algo.kl_ctrl == "adaptive" and not algo.kl_in_reward:
        raise config_error(
            "algo.kl_ctrl",
            "adaptive",
            "the adaptive controller adjusts the KL penalty in the reward, which is off",
            "set algo.kl_in_reward=true (algo.name=ppo), or algo.kl_ctrl=fixed",
        )
    if algo.kl_in_reward and resolved_kl_coef(algo) == 0:
        raise config_error(
            "algo.kl_in_reward",
            True,
            "a KL penalty needs the reference model, and algo.kl_coef=0 skips it",
            "set algo.kl_coef > 0 (the initial coefficient), or algo.kl_in_reward=false",
        )
    if not runs_critic(algo):
        if algo.critic_warmup_steps:
            raise config_error(
                "algo.critic_warmup_steps",
                algo.critic_warmup_steps,
                f"algo.name={algo.name} has no critic to warm up",
                "set algo.name=ppo, or algo.critic_warmup_steps=0",
            )
        if critic != CriticConfig():
            warnings.warn(
                f"critic settings have no effect with algo.name={algo.name} (only ppo has a critic)",
                stacklevel=4,
            )
        return
    for key, value in (("algo.gamma", algo.gamma), ("algo.lam", algo.lam)):
        if not 0 <= value <= 1:
            raise config_error(key, value, "must be in [0, 1]", "use e.g. 1.0")
    positive("algo.kl_target", algo.kl_target)
    positive("algo.kl_horizon", algo.kl_horizon)
    positive("algo.critic_warmup_steps", algo.critic_warmup_steps, allow_zero=True)
    if algo.critic_warmup_steps >= cfg.run.steps:
        warnings.warn(
            f"algo.critic_warmup_steps={algo.critic_warmup_steps} >= run.steps={cfg.run.steps}: the actor never updates",
            stacklevel=4,
        )
    for key in ("dp", "cp", "micro_batch_size", "mini_batches", "epochs"):
        positive(f"critic.{key}", getattr(critic, key))
    positive("critic.lr", critic.lr)
    if critic.value_clip is not None:
        positive("critic.value_clip", critic.value_clip)
    rows = cfg.run.prompts_per_step * cfg.rollout.samples_per_prompt
    if rows % critic.dp:
        raise config_error(
            "critic.dp",
            critic.dp,
            f"does not divide the {rows} rows of a step (run.prompts_per_step x rollout.samples_per_prompt)",
            f"use a divisor of {rows}",
        )
    if rows // critic.dp % critic.mini_batches:
        raise config_error(
            "critic.mini_batches",
            critic.mini_batches,
            f"does not divide the {rows // critic.dp} rows each critic rank trains on per step",
            f"use a divisor of {rows // critic.dp}",
        )
