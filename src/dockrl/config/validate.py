"""Pure cross-field rules of job configs: `check_train` and `check_sft` raise ConfigError or warn, and change
nothing. They read the config only (no file, device, logger or run directory: recipes/preflight.py checks
those, then `config.resolve` fills in what depends on them). They run in the driver before Ray or any
worker process starts.

Every error names the setting, the value and the fix. Settings that have no effect in a combination get a
warning. The RL objective's rules live in `algo_checks.py`, the leaf check of a positive number in `checks.py`.
"""

from __future__ import annotations

import math
import warnings

from dockrl.algos.registry import KL_ESTIMATORS, LOSS_AGGS
from dockrl.config.algo_checks import check_algorithm, check_dynamic_sampling, own_estimator, runs_critic
from dockrl.config.checks import positive
from dockrl.config.env_checks import check_env
from dockrl.config.fields import config_error
from dockrl.config.lora_checks import check_lora
from dockrl.config.schema import (
    FSDP_UNIT_PARAMS,
    DataConfig,
    DistillConfig,
    RewardModelConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)
from dockrl.config.step_plan import resolved_clip, resolved_kl_coef, traits_of


def check_train(cfg: TrainConfig) -> None:
    """The rules of a `dockrl train` config that need nothing but the config (recipes/preflight.py runs them
    first, then checks files and devices)."""
    run, roll, actor, algo = cfg.run, cfg.rollout, cfg.actor, cfg.algo
    kl_coef = resolved_kl_coef(algo)  # the algorithm's own when unset
    for key, value in [
        ("run.steps", run.steps),
        ("run.prompts_per_step", run.prompts_per_step),
        ("rollout.samples_per_prompt", roll.samples_per_prompt),
        ("rollout.max_new_tokens", roll.max_new_tokens),
        ("rollout.max_batch_size", roll.max_batch_size),
        ("rollout.groups_per_pull", roll.groups_per_pull),
        ("actor.dp", actor.dp),
        ("actor.micro_batch_size", actor.micro_batch_size),
        ("actor.mini_batches", actor.mini_batches),
        ("actor.epochs", actor.epochs),
        ("reward.num_workers", cfg.reward.num_workers),
        ("reward.groups_per_pull", cfg.reward.groups_per_pull),
    ]:
        positive(key, value)
    positive("actor.lr", actor.lr)
    positive("actor.fsdp_unit_params", actor.fsdp_unit_params, allow_zero=True)
    positive("critic.fsdp_unit_params", cfg.critic.fsdp_unit_params, allow_zero=True)
    positive("reward.timeout_s", cfg.reward.timeout_s)
    positive("reward.num_processes", cfg.reward.num_processes, allow_zero=True)
    positive("run.save_every", run.save_every, allow_zero=True)
    positive("run.eval_every", run.eval_every, allow_zero=True)
    if run.threads_per_rank < 0:
        raise config_error(
            "run.threads_per_rank",
            run.threads_per_rank,
            "must be >= 0",
            "use 0 (auto: on cpu each group's ranks split the cores) or N >= 1 torch threads per trainer rank",
        )
    _check_resume(cfg)
    check_algorithm(cfg)
    if roll.temperature < 0:
        raise config_error("rollout.temperature", roll.temperature, "must be >= 0", "use 0 (greedy) or above")
    if not 0 < roll.top_p <= 1:
        raise config_error(
            "rollout.top_p", roll.top_p, "must be in (0, 1]", "use 1.0 to turn nucleus sampling off"
        )
    if roll.top_k < 0:
        raise config_error("rollout.top_k", roll.top_k, "must be >= 0", "use 0 to turn top-k off")
    if not 0 <= roll.min_p < 1:
        raise config_error("rollout.min_p", roll.min_p, "must be in [0, 1)", "use 0.0 to turn min-p off")
    if any(not isinstance(s, str) or not s for s in roll.stop_strings):
        raise config_error(
            "rollout.stop_strings", roll.stop_strings, "must be non-empty strings", "remove the empty entry"
        )
    if roll.max_batch_size < roll.samples_per_prompt:
        raise config_error(
            "rollout.max_batch_size",
            roll.max_batch_size,
            f"must hold one whole group of rollout.samples_per_prompt={roll.samples_per_prompt} sequences",
            f"set it to at least {roll.samples_per_prompt}",
        )
    _check_kv_cache_tokens(roll, cfg.data.max_prompt_len)
    rows = run.prompts_per_step * roll.samples_per_prompt
    if rows % actor.dp:
        raise config_error(
            "run.prompts_per_step",
            run.prompts_per_step,
            f"rows per step = {run.prompts_per_step} x {roll.samples_per_prompt} = {rows} is not divisible by actor.dp={actor.dp}",
            "make prompts_per_step x samples_per_prompt a multiple of actor.dp",
        )
    rows_per_rank = rows // actor.dp
    if rows_per_rank % actor.mini_batches:
        raise config_error(
            "actor.mini_batches",
            actor.mini_batches,
            f"does not divide the {rows_per_rank} rows each rank trains on per step",
            f"use a divisor of {rows_per_rank}",
        )
    if algo.kl_estimator not in KL_ESTIMATORS:
        raise config_error(
            "algo.kl_estimator", algo.kl_estimator, "unknown estimator", f"use one of {KL_ESTIMATORS}"
        )
    if algo.loss_agg is not None and algo.loss_agg not in LOSS_AGGS:
        raise config_error("algo.loss_agg", algo.loss_agg, "unknown aggregation", f"use one of {LOSS_AGGS}")
    if kl_coef < 0:
        raise config_error(
            "algo.kl_coef", kl_coef, "must be >= 0", "use 0 to train without a reference model"
        )
    clip_low, clip_high = resolved_clip(algo)
    if clip_low < 0 or clip_high < 0 or clip_low >= 1:
        raise config_error(
            "algo.clip_low",
            (clip_low, clip_high),
            "clip ranges must be >= 0 and clip_low < 1",
            "use e.g. clip_low=0.2 clip_high=0.28",
        )
    if roll.samples_per_prompt == 1 and algo.norm_adv_by_std and traits_of(algo).group_baseline:
        warnings.warn(
            "rollout.samples_per_prompt=1: group-baseline advantages are all zero with groups of one; "
            "use samples_per_prompt >= 2 (or algo.name=reinforce_pp)",
            stacklevel=2,
        )
    lora = check_lora(actor.lora, has_critic=runs_critic(algo))
    if lora is not None and cfg.model.ref_path is not None:
        raise config_error(
            "model.ref_path",
            cfg.model.ref_path,
            "with actor.lora the KL reference is the policy's own base, with the adapters off or at model.lora_path's "
            "starting values (algo.kl_reference; no second model)",
            "remove model.ref_path",
        )
    if kl_coef == 0 and cfg.model.ref_path is not None:
        warnings.warn(
            "model.ref_path has no effect with algo.kl_coef=0 (no reference model is loaded)", stacklevel=2
        )
    _check_rewards(cfg)
    check_dynamic_sampling(cfg)
    if cfg.dock.num_warehouses is not None:
        positive("dock.num_warehouses", cfg.dock.num_warehouses)
    _check_dock(cfg)
    check_data(cfg.data)
    _check_reward_model(cfg)
    _check_distill(cfg)
    _check_filtered_logprobs(cfg)
    _check_layouts(cfg)
    check_env(cfg)


def _check_resume(cfg: TrainConfig) -> None:
    """run.resume and the checkpoint settings (that a resume path is a complete checkpoint: the preflight)."""
    run = cfg.run
    if run.keep_checkpoints is not None:
        positive("run.keep_checkpoints", run.keep_checkpoints)
    positive("run.max_restarts", run.max_restarts, allow_zero=True)
    positive("run.heartbeat_timeout_s", run.heartbeat_timeout_s)
    if run.resume == "auto" and run.name is None:
        raise config_error(
            "run.resume",
            "auto",
            "resumes from the run directory run.output_dir/run.name, and run.name is unset (each run gets a "
            "new timestamped directory, so there is never anything to resume)",
            "set run.name, e.g. run.name=my-run",
        )


def _check_layouts(cfg: TrainConfig) -> None:
    """Training (dp, tp) and rollout tp layouts against each other (against the model: the preflight)."""
    actor, roll = cfg.actor, cfg.rollout
    positive("actor.tp", actor.tp)
    positive("actor.cp", actor.cp)
    positive("actor.ep", actor.ep)
    if actor.cp > 1 and actor.ep > 1:
        raise config_error(
            "actor.cp",
            actor.cp,
            f"with actor.ep={actor.ep}: context parallelism of MoE models is not built",
            "use actor.cp=1 with expert parallelism",
        )
    _check_aux_loss_coef(actor)
    if actor.dp % actor.ep:
        raise config_error(
            "actor.ep",
            actor.ep,
            f"does not divide actor.dp={actor.dp} (the experts are split over ep ranks and sharded over the "
            "dp / ep ranks holding the same ones)",
            f"use a divisor of actor.dp: {[d for d in range(1, actor.dp + 1) if actor.dp % d == 0]}",
        )
    if actor.ep > 1 and actor.tp > 1:
        raise config_error(
            "actor.ep",
            actor.ep,
            f"with actor.tp={actor.tp}: tensor parallelism of MoE layers is not built",
            "use actor.tp=1 with expert parallelism",
        )
    positive("rollout.tp", roll.tp)
    world = actor.dp * actor.cp * actor.tp
    positive("rollout.replicas", roll.replicas)
    if roll.placement == "colocated" and roll.replicas != 1:
        raise config_error(
            "rollout.replicas",
            roll.replicas,
            "colocated rollout runs on the actor's ranks (actor.dp x actor.cp x actor.tp / rollout.tp replicas)",
            "set rollout.placement=separate for replicas of their own, or leave rollout.replicas=1",
        )
    if roll.placement == "separate" and roll.tp != 1:
        raise config_error(
            "rollout.tp",
            roll.tp,
            "rollout.placement=separate sends full weights to single-rank replicas (tensor-parallel separate "
            "replicas are not built yet)",
            "use rollout.tp=1 with several rollout.replicas, or rollout.placement=colocated",
        )
    _check_backend(roll)
    positive("rollout.max_staleness", roll.max_staleness, allow_zero=True)
    if roll.max_staleness > 8:
        raise config_error(
            "rollout.max_staleness",
            roll.max_staleness,
            "each step ahead keeps a dock of rows and a staged copy of the weights on every rollout replica, "
            "and off-policy corrections degrade past a few versions",
            "use a rollout.max_staleness of 0 to 8 (1 or 2 is typical)",
        )
    positive("rollout.partial_tokens", roll.partial_tokens, allow_zero=True)
    if roll.partial:
        if roll.max_staleness < 1:
            raise config_error(
                "rollout.partial",
                True,
                "a response cut at one step is finished by a later step's weights, which needs a staleness "
                "budget (a row is cut at most rollout.max_staleness times)",
                "set rollout.max_staleness to 1 or more, or rollout.partial=false",
            )
        if roll.partial_tokens >= roll.max_new_tokens:
            raise config_error(
                "rollout.partial_tokens",
                roll.partial_tokens,
                f"no response is ever cut with a budget of rollout.max_new_tokens={roll.max_new_tokens} or more",
                "use fewer tokens (0 picks rollout.max_new_tokens / 4), or rollout.partial=false",
            )
    elif roll.partial_tokens:
        warnings.warn(
            f"rollout.partial_tokens={roll.partial_tokens} has no effect without rollout.partial=true",
            stacklevel=3,
        )
    if roll.max_staleness and roll.placement != "separate" and not roll.partial:
        raise config_error(
            "rollout.max_staleness",
            roll.max_staleness,
            "colocated rollout shares the actor's ranks, so it cannot run while they train",
            "set rollout.placement=separate (rollout replicas of their own), rollout.partial=true, or "
            "rollout.max_staleness=0",
        )
    algo = cfg.algo
    if algo.routing_replay == "r3":
        from dockrl.backends import backend

        if not backend(roll.backend).records_routes:
            raise config_error(
                "algo.routing_replay",
                "r3",
                f"replays the experts the rollout engine records; rollout.backend={roll.backend} does not "
                "record them",
                "use rollout.backend=dockrl, or algo.routing_replay=none",
            )
        if cfg.env.name is not None:
            raise config_error(
                "algo.routing_replay",
                "r3",
                "multi-turn trajectories (env.name) do not carry the experts of their observation tokens yet",
                "use algo.routing_replay=none with env.name",
            )
    if algo.old_logprobs == "rollout":
        if algo.kl_in_reward or algo.rollout_is != "none":
            what = "algo.kl_in_reward" if algo.kl_in_reward else f"algo.rollout_is={algo.rollout_is}"
            raise config_error(
                "algo.old_logprobs",
                "rollout",
                f"{what} needs the policy's own log-probs before the update (the old log-prob stage)",
                "use algo.old_logprobs=recompute",
            )
        if cfg.actor.mini_batches == 1 and cfg.actor.epochs == 1 and roll.max_staleness == 0:
            warnings.warn(
                "algo.old_logprobs=rollout has no effect with one on-policy update (actor.mini_batches=1, "
                "actor.epochs=1, rollout.max_staleness=0): the update's old log-probs are its current ones",
                stacklevel=3,
            )
    single_update = cfg.actor.mini_batches == 1 and cfg.actor.epochs == 1
    if (
        roll.max_staleness
        and single_update
        and algo.rollout_is == "none"
        and algo.old_logprobs == "recompute"
    ):
        warnings.warn(
            f"rollout.max_staleness={roll.max_staleness} with algo.rollout_is=none: rows sampled by weights up to "
            f"{roll.max_staleness} updates old train uncorrected (one update per step clips against the current "
            "policy, so the clip never acts); set algo.rollout_is=tis or decoupled to weight them by "
            "current / behaviour policy",
            stacklevel=3,
        )
    if roll.max_staleness and (runs_critic(algo) or algo.dynamic_sampling):
        what = f"algo.name={algo.name}" if runs_critic(algo) else "algo.dynamic_sampling"
        raise config_error(
            "rollout.max_staleness",
            roll.max_staleness,
            f"asynchronous (or partial) rollout with {what} is not built yet",
            "use rollout.max_staleness=0",
        )
    if roll.placement == "colocated" and cfg.placement.rollout:
        warnings.warn(
            f"placement.rollout={cfg.placement.rollout} has no effect with rollout.placement=colocated (rollout "
            "runs on the actor's ranks, placed by placement.actor)",
            stacklevel=3,
        )
    if world % roll.tp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise config_error(
            "rollout.tp",
            roll.tp,
            f"does not divide the actor's actor.dp x actor.cp x actor.tp = {world} ranks",
            f"use one of {divisors} (or change actor.dp / actor.cp / actor.tp)",
        )


def _check_rewards(cfg: TrainConfig) -> None:
    """Something scores the rows (whether each reward function resolves: the preflight)."""
    if not cfg.reward.functions and cfg.reward.model.path is None:
        raise config_error(
            "reward.functions",
            [],
            "no reward function and no reward model is configured",
            "add e.g. {name: exact_answer} or set reward.model.path",
        )
    if not cfg.reward.functions and cfg.data.eval_path is not None:
        raise config_error(
            "data.eval_path",
            cfg.data.eval_path,
            "held-out answers are scored by reward.functions, and reward.functions is empty",
            "add a rule reward such as {name: exact_answer} or unset data.eval_path",
        )


def _check_reward_model(cfg: TrainConfig) -> None:
    """reward.model's numbers (its checkpoint, tokenizer and GPUs: the preflight)."""
    rm = cfg.reward.model
    if rm.path is None:
        if rm != RewardModelConfig():
            warnings.warn("reward.model settings have no effect without reward.model.path", stacklevel=3)
        return
    positive("reward.model.num_workers", rm.num_workers)
    positive("reward.model.micro_batch_size", rm.micro_batch_size)
    if not math.isfinite(rm.weight):
        raise config_error("reward.model.weight", rm.weight, "must be finite", "use e.g. 1.0")


def _check_distill(cfg: TrainConfig) -> None:
    """distill.*: a teacher for the algorithms that read it, its numbers (its checkpoint and vocabulary: the
    preflight)."""
    distill, algo = cfg.distill, cfg.algo
    estimator, own = traits_of(algo), own_estimator(algo)
    if distill.teacher_path is None:
        if own.needs_teacher or estimator.needs_teacher:
            chosen = ("algo.adv_estimator", estimator.name)
            key, value = ("algo.name", algo.name) if own.needs_teacher else chosen
            raise config_error(
                key,
                value,
                "trains on the teacher's per-token log-probs alone, and distill.teacher_path is unset",
                "set distill.teacher_path to a teacher model with the policy's tokenizer",
            )
        if distill != DistillConfig():
            warnings.warn("distill settings have no effect without distill.teacher_path", stacklevel=3)
        return
    positive("distill.num_workers", distill.num_workers)
    positive("distill.tp", distill.tp)
    positive("distill.micro_batch_size", distill.micro_batch_size)
    positive("distill.max_tokens_per_micro_batch", distill.max_tokens_per_micro_batch, allow_zero=True)
    positive("distill.top_k", distill.top_k, allow_zero=True)
    if not math.isfinite(distill.coef) or distill.coef < 0:
        raise config_error(
            "distill.coef",
            distill.coef,
            "is the weight of the teacher term (in the advantages, or the loss with distill.top_k) and must be "
            "finite and >= 0",
            "use 1.0 (algo.name=opd), a smaller weight beside a reward, or 0 to log distill/* only",
        )
    positive("distill.cp", distill.cp)
    divisors = [d for d in range(1, distill.num_workers + 1) if distill.num_workers % d == 0]
    if distill.num_workers % distill.tp:
        raise config_error(
            "distill.tp",
            distill.tp,
            f"does not divide distill.num_workers={distill.num_workers}",
            f"use a divisor: {divisors}",
        )
    if distill.num_workers % (distill.cp * distill.tp):
        raise config_error(
            "distill.cp",
            distill.cp,
            f"times distill.tp={distill.tp} does not divide distill.num_workers={distill.num_workers} (the "
            "teacher's ranks form a (dp, cp, tp) grid)",
            f"use a cp with cp x {distill.tp} among {divisors}, or raise distill.num_workers",
        )
    if estimator.needs_critic:
        raise config_error(
            "distill.teacher_path",
            distill.teacher_path,
            "adds a per-token term to the reward stage's advantages, and ppo's advantages come from its critic "
            "(GAE) instead",
            "use a group algorithm (grpo, rloo, ...) or algo.name=opd with a teacher",
        )
    if own.needs_teacher and algo.dynamic_sampling:
        raise config_error(
            "algo.dynamic_sampling",
            True,
            f"keeps groups whose rewards differ, and algo.name={algo.name} does not train on rewards",
            f"use algo.dynamic_sampling=false with algo.name={algo.name}",
        )


def _check_aux_loss_coef(actor) -> None:
    """actor.moe_aux_loss_coef is a loss weight (train and sft alike)."""
    if actor.moe_aux_loss_coef < 0:
        raise config_error(
            "actor.moe_aux_loss_coef",
            actor.moe_aux_loss_coef,
            "is a loss weight and must be >= 0",
            "use 0 (log only) or a small weight such as 0.001",
        )


def check_sft(cfg: SFTConfig) -> None:
    """The rules of a `dockrl sft` config that need nothing but the config (then recipes/preflight.py)."""
    positive("run.batch_size", cfg.run.batch_size)
    positive("run.epochs", cfg.run.epochs)
    positive("actor.micro_batch_size", cfg.actor.micro_batch_size)
    positive("actor.lr", cfg.actor.lr)
    if cfg.actor.dp != 1:
        raise config_error("actor.dp", cfg.actor.dp, "dockrl sft runs in one process", "use actor.dp=1")
    if cfg.actor.tp != 1:
        raise config_error("actor.tp", cfg.actor.tp, "dockrl sft runs in one process", "use actor.tp=1")
    if cfg.actor.ep != 1:
        raise config_error("actor.ep", cfg.actor.ep, "dockrl sft runs in one process", "use actor.ep=1")
    if cfg.actor.cp != 1:
        raise config_error("actor.cp", cfg.actor.cp, "dockrl sft runs in one process", "use actor.cp=1")
    if cfg.actor.fsdp_unit_params != FSDP_UNIT_PARAMS:
        raise config_error(
            "actor.fsdp_unit_params",
            cfg.actor.fsdp_unit_params,
            "dockrl sft runs in one process, without FSDP2",
            "leave actor.fsdp_unit_params unset",
        )
    _check_aux_loss_coef(cfg.actor)
    for key, value in (("actor.mini_batches", cfg.actor.mini_batches), ("actor.epochs", cfg.actor.epochs)):
        if value != 1:
            raise config_error(
                key,
                value,
                "dockrl sft takes one optimizer step per batch",
                "use run.batch_size and run.epochs",
            )
    if cfg.model.ref_path is not None:
        raise config_error(
            "model.ref_path", cfg.model.ref_path, "SFT has no reference model", "remove model.ref_path"
        )
    lora = cfg.actor.lora
    lora_keys = {
        "actor.lora.rank": lora.rank or None,
        "actor.lora.alpha": lora.alpha,
        "actor.lora.dropout": lora.dropout,
        "actor.lora.target_modules": lora.target_modules,
        "model.lora_path": cfg.model.lora_path,
    }
    for lora_key, lora_value in lora_keys.items():
        if lora_value is not None:
            raise config_error(
                lora_key, lora_value, "dockrl sft trains every weight (LoRA SFT is not built)", "remove it"
            )
    if cfg.data.label_field is None:
        raise config_error("data.label_field", None, "SFT needs the answer text", "name the answer field")
    check_data(cfg.data)


def _check_kv_cache_tokens(roll: RolloutConfig, max_prompt_len: int) -> None:
    """rollout.kv_cache_tokens: 0 (every slot's worst case) or room for one whole sequence; rollout.kv_cache=slots
    within it; dockrl's engine only."""
    tokens = roll.kv_cache_tokens
    positive("rollout.kv_cache_tokens", tokens, allow_zero=True)
    longest = max_prompt_len + roll.max_new_tokens
    if 0 < tokens < longest:
        raise config_error(
            "rollout.kv_cache_tokens",
            tokens,
            f"cannot hold one sequence of data.max_prompt_len + rollout.max_new_tokens = {max_prompt_len} + "
            f"{roll.max_new_tokens} = {longest} positions",
            f"set it to at least {longest}, or 0 for max_batch_size x {longest}",
        )
    worst = roll.max_batch_size * longest
    if roll.kv_cache == "slots" and 0 < tokens < worst:
        raise config_error(
            "rollout.kv_cache",
            roll.kv_cache,
            f"needs rollout.max_batch_size x (data.max_prompt_len + rollout.max_new_tokens) = {roll.max_batch_size}"
            f" x {longest} = {worst} positions, over rollout.kv_cache_tokens={tokens}",
            "use rollout.kv_cache=auto (paged where slots do not fit) or paged, or raise rollout.kv_cache_tokens",
        )
    if roll.backend != "dockrl":
        for name, value, default in (
            ("kv_cache_tokens", tokens, 0),
            ("kv_cache", roll.kv_cache, "auto"),
        ):
            if value != default:
                warnings.warn(
                    f"rollout.{name}={value} has no effect with rollout.backend={roll.backend} (dockrl's "
                    "engine only; vLLM sizes its own cache)",
                    stacklevel=4,
                )


def check_data(data: DataConfig) -> None:
    """The data section, shared by dockrl train and dockrl sft (both read every setting of it; the files
    themselves: the preflight)."""
    positive("data.max_prompt_len", data.max_prompt_len)
    if data.eval_limit is not None:
        positive("data.eval_limit", data.eval_limit)
        if data.eval_path is None:
            warnings.warn(
                f"data.eval_limit={data.eval_limit} has no effect without data.eval_path", stacklevel=4
            )


def _check_dock(cfg: TrainConfig) -> None:
    dock = cfg.dock
    if dock.mode not in ("dock", "single", "driver"):
        raise config_error("dock.mode", dock.mode, "unknown dock mode", "use dock, single or driver")
    if dock.transport not in ("socket", "ray"):
        raise config_error("dock.transport", dock.transport, "unknown transport", "use socket or ray")
    if dock.max_rows is not None:
        positive("dock.max_rows", dock.max_rows)
        rows = cfg.run.prompts_per_step * cfg.rollout.samples_per_prompt
        what = f"one step's {rows} rows"
        if cfg.algo.dynamic_sampling:  # each round may add up to a step's rows
            rows *= cfg.algo.max_sampling_rounds
            what = f"the {rows} rows of algo.max_sampling_rounds={cfg.algo.max_sampling_rounds} rounds"
        if dock.max_rows < rows:
            raise config_error("dock.max_rows", dock.max_rows, f"cannot hold {what}", f"use >= {rows}")
    if dock.num_warehouses is not None and dock.mode != "dock":
        warnings.warn(f"dock.num_warehouses has no effect with dock.mode={dock.mode}", stacklevel=3)
    if dock.transport != "socket" and dock.mode == "driver":  # the driver's own hub moves every byte
        warnings.warn(
            f"dock.transport={dock.transport} has no effect with dock.mode=driver (payload goes through the "
            "driver's socket hub); it applies to dock.mode=dock and single",
            stacklevel=3,
        )


def _check_backend(roll: RolloutConfig) -> None:
    """rollout.backend names a registered backend (backends), whose section's settings can work."""
    from dockrl.backends import backend, names

    if roll.backend not in names():
        raise config_error("rollout.backend", roll.backend, "unknown backend", f"use one of {list(names())}")
    entry = backend(roll.backend)
    if entry.settings is not None:
        for key, value, problem, fix in entry.settings_problems(getattr(roll, roll.backend)):
            raise config_error(key, value, problem, fix)


def _check_filtered_logprobs(cfg: TrainConfig) -> None:
    """A sampling filter at a temperature where the backend reports the filtered, renormalised log-probs (log p -
    log Z) instead of the model's: every correction that reads rollout_logprobs would carry the -log Z bias
    (importance weights ~Z < 1 on every token, a PPO ratio starting at Z, a teacher term off by log Z)."""
    from dockrl.backends import backend

    roll, algo = cfg.rollout, cfg.algo
    filters = [(k, v) for k, v, off in _sampling_filters(roll) if v != off]
    if not filters or backend(roll.backend).unfiltered_logprobs(roll.temperature):
        return
    off_policy = not (cfg.actor.mini_batches == 1 and cfg.actor.epochs == 1 and roll.max_staleness == 0)
    readers = [
        (f"algo.rollout_is={algo.rollout_is}", algo.rollout_is != "none"),
        ("algo.old_logprobs=rollout", algo.old_logprobs == "rollout" and off_policy),
        ("distill.teacher_path", cfg.distill.teacher_path is not None),
    ]
    for reader, on in readers:
        if on:
            key, value = filters[0]
            raise config_error(
                key,
                value,
                f"with rollout.backend={roll.backend} at rollout.temperature={roll.temperature:g} the rollout's "
                f"log-probs are those of the filtered, renormalised distribution (log p - log Z), which {reader} "
                "compares with the trainer's unfiltered ones",
                "use rollout.temperature=1 (its log-probs are then the model's whatever the filter), turn the "
                f"filter off, use rollout.backend=dockrl, or drop {reader}",
            )


def _sampling_filters(roll: RolloutConfig) -> list[tuple[str, float, float]]:
    """(setting, value, its off value) of each sampling filter."""
    return [
        ("rollout.top_p", roll.top_p, 1.0),
        ("rollout.top_k", roll.top_k, 0),
        ("rollout.min_p", roll.min_p, 0.0),
    ]
