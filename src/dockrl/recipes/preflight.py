"""Preflight: the checks of a job config that touch the machine, and the resolution that depends on them. Runs
in the driver before Ray or any worker process starts, so every user error is a ConfigError naming the setting.

    preflight_train(cfg) -> Resolved
        check_train(cfg)            the pure rules (config/validate.py)
        checkpoint roots            model.path / critic.path naming a checkpoint: the directories it holds
        files                       resume checkpoint, reward functions, dock policy, model dirs, datasets
        device, precision           run.device / run.precision auto -> what this machine computes with
        resolve(cfg, found)         the frozen Resolved (config/resolve.py); the user's cfg is never changed
        loggers, GPUs, reward model, the model's shapes against the layouts
    preflight_sft(cfg) -> SFTConfig  the same for `dockrl sft`: a resolved copy of cfg
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from typing import Any

from dockrl.config.algo_checks import runs_critic
from dockrl.config.fields import config_error
from dockrl.config.resolve import Resolved, copy_with, resolve
from dockrl.config.schema import DataConfig, SFTConfig, TrainConfig
from dockrl.config.validate import check_sft, check_train
from dockrl.errors import ConfigError
from dockrl.models.families import ALL_LINEAR, MLP_LINEARS, linear_targets


def resolve_device(device: str, key: str = "run.device") -> str:
    """`auto` -> cuda when available, else cpu; `cuda` without CUDA is an error."""
    if device == "cpu":
        return device  # no torch import for that: a CPU run's driver starts a second and a half sooner
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise config_error(key, device, "unknown device", "use cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise config_error(key, device, "CUDA is not available on this machine", "use cpu or auto")
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX tiles): the kernel's CPU flags on
    Linux (what torch's CPUID checks read, without importing torch), else torch's checks."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is not None:
        return "avx512_bf16" in flags or "amx_tile" in flags
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_precision(precision: str, device: str, key: str = "run.precision") -> str:
    """`auto` -> bf16 on cuda and on a cpu that computes bf16 natively, else fp32.

    On the project's avx512_bf16 CPU bf16 matmuls run at 2-4x the fp32 rate at the widths measured (hidden 128
    and 256), and a decoder's forward and backward pass at 1.5-2x (README, "Speed against TRL")."""
    if precision == "auto":
        return "bf16" if device == "cuda" or cpu_has_native_bf16() else "fp32"
    if precision not in ("fp32", "bf16"):
        raise config_error(key, precision, "unknown precision", "use fp32, bf16 or auto")
    return precision


def check_model_dir(path: str, key: str) -> None:
    """A model directory must exist and hold config.json."""
    p = Path(path)
    if not p.is_dir():
        raise config_error(
            key,
            path,
            "the model directory does not exist",
            "pass a Hugging Face checkpoint directory (build a tiny one with `dockrl make-tiny DIR`)",
        )
    if not (p / "config.json").is_file():
        raise config_error(
            key, path, "the directory has no config.json", "pass a Hugging Face checkpoint directory"
        )


def check_dataset(path: str, prompt_field: str, label_field: str | None, key: str) -> None:
    """The dataset file must exist and its first row must hold the prompt (and label) field."""
    from dockrl.data.datasets import load_prompts

    if not Path(path).is_file():
        raise config_error(key, path, "the dataset file does not exist", "pass a .jsonl or .parquet file")
    load_prompts(path, prompt_field=prompt_field, label_field=label_field, limit=1)


def preflight_train(cfg: TrainConfig) -> Resolved:
    """Check a `dockrl train` config (the pure rules, then files, devices and loggers) and resolve it; `cfg`
    itself is not changed. Raises ConfigError (or the dataset's ValueError) naming the setting."""
    check_train(cfg)
    plan = resolve(cfg).plan  # what the run needs (a reference model, a critic), before anything is found
    found = _checkpoint_roots(cfg, plan.reference)
    _check_resume_path(cfg)
    _check_reward_functions(cfg)
    _check_dock_policy(cfg)
    check_model_dir(found.get("model.path", cfg.model.path), "model.path")
    _check_environment(cfg, found.get("model.path", cfg.model.path))
    ref_path = found.get("model.ref_path", cfg.model.ref_path)
    if ref_path is not None:
        check_model_dir(ref_path, "model.ref_path")
    if plan.critic and cfg.critic.path is not None:
        check_model_dir(found.get("critic.path", cfg.critic.path), "critic.path")
    _check_data_files(cfg.data)
    found.update(_lora_adapter(cfg, found.get("model.lora_path", cfg.model.lora_path)))
    found["run.device"] = resolve_device(cfg.run.device)
    found["run.precision"] = resolve_precision(cfg.run.precision, found["run.device"])
    resolved = resolve(cfg, found)
    run_cfg = resolved.cfg
    _check_loggers(run_cfg.run.loggers)
    actor = run_cfg.actor
    teacher_ranks = run_cfg.distill.num_workers if run_cfg.distill.teacher_path is not None else 0
    critic_ranks = run_cfg.critic.dp * run_cfg.critic.cp if plan.critic else 0
    trainer_ranks = actor.dp * actor.cp * actor.tp + critic_ranks + teacher_ranks
    _check_devices(run_cfg.run.device, trainer_ranks)
    _check_threads(run_cfg.run.device, run_cfg.run.threads_per_rank, trainer_ranks)
    _check_reward_model_files(run_cfg)
    _check_teacher(run_cfg)
    _check_model_layouts(run_cfg)
    _check_backend(run_cfg)
    return resolved


def preflight_sft(cfg: SFTConfig) -> SFTConfig:
    """Check a `dockrl sft` config (the pure rules, then files, devices and loggers); returns a resolved copy
    (run.device and run.precision never auto), `cfg` itself is not changed."""
    check_sft(cfg)
    check_model_dir(cfg.model.path, "model.path")
    _check_data_files(cfg.data)
    _check_loggers(cfg.run.loggers)
    device = resolve_device(cfg.run.device)
    precision = resolve_precision(cfg.run.precision, device)
    return copy_with(cfg, {"run.device": device, "run.precision": precision})


def _lora_adapter(cfg: TrainConfig, lora_path: str | None) -> dict[str, Any]:
    """model.lora_path (or the adapter/ of a LoRA checkpoint root in model.path): the PEFT adapter's rank,
    alpha and targets become actor.lora's (a key the user set must agree; its dropout is not taken over); {}
    without one."""
    if lora_path is None:
        if cfg.algo.kl_reference != "adapter":
            warnings.warn(
                f"algo.kl_reference={cfg.algo.kl_reference} has no effect without model.lora_path (fresh "
                "adapters add 0: the base is the starting policy)",
                stacklevel=2,
            )
        return {}
    from dockrl.models.lora import read_peft_spec  # torch: only when there is an adapter to read

    try:
        spec = read_peft_spec(lora_path)
    except (OSError, ValueError, KeyError) as exc:
        raise config_error(
            "model.lora_path",
            lora_path,
            f"not a usable PEFT adapter ({exc})",
            "point it at a directory PEFT's save_pretrained wrote",
        ) from None
    adapter = {"rank": spec.rank, "alpha": spec.alpha, "target_modules": list(spec.target_modules)}
    lora = cfg.actor.lora
    if spec.dropout > 0 and lora.dropout is None:
        # PEFT's training default (0.05 and the like) is not taken over: under RL the rollout, the old
        # log-probs and the update would each see other dropout masks
        warnings.warn(
            f"model.lora_path={lora_path}: the adapter's lora_dropout={spec.dropout} is not applied (RL trains "
            "its adapters without dropout unless actor.lora.dropout says otherwise)",
            stacklevel=2,
        )
    for key, value in adapter.items():
        mine = getattr(lora, key)
        if key == "rank" and mine == 0 or mine is None:
            continue
        same = (
            list(linear_targets(mine, "actor.lora.target_modules")) == value
            if key == "target_modules"
            else mine == value
        )
        if not same:
            raise config_error(
                f"actor.lora.{key}",
                mine,
                f"differs from the adapter's {value} in model.lora_path",
                "leave it unset (the adapter's is used) or match it",
            )
    if cfg.model.ref_path is not None:
        raise config_error(
            "model.ref_path",
            cfg.model.ref_path,
            "with a LoRA adapter the KL reference is the starting adapter on the base (algo.kl_reference=adapter) "
            "or the base with the adapters off (algo.kl_reference=base)",
            "remove model.ref_path",
        )
    return {f"actor.lora.{key}": value for key, value in adapter.items()} | {"model.lora_path": lora_path}


def _checkpoint_roots(cfg: TrainConfig, reference: bool) -> dict[str, Any]:
    """model.path / critic.path may name a checkpoint root: load its Hugging Face exports, and keep the KL
    reference of the run that wrote it (model.ref_path unset) instead of silently moving it to the checkpoint.
    Returns the settings found (dotted key -> value)."""
    from dockrl.checkpoint.directory import (
        adapter_base,
        is_checkpoint,
        lora_adapter_dir,
        read_trainer_state,
        resolve_critic_path,
        resolve_model_path,
    )

    found: dict[str, Any] = {}
    adapter = lora_adapter_dir(cfg.model.path)
    if adapter is not None:  # a LoRA checkpoint: its base, its adapters in model.lora_path (training goes on)
        try:
            found["model.path"] = adapter_base(adapter)
        except FileNotFoundError as exc:
            raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from exc
        if cfg.model.lora_path is None:
            found["model.lora_path"] = str(adapter)
    elif is_checkpoint(cfg.model.path):
        root = cfg.model.path
        found["model.path"] = resolve_model_path(root)
        if cfg.model.ref_path is None and reference:
            found["model.ref_path"] = read_trainer_state(root)["reference_path"]
            warnings.warn(
                f"model.path={root} is a checkpoint: the policy starts from its hf/ export and the KL reference "
                f"stays that run's reference {found['model.ref_path']} (set model.ref_path to choose another)",
                stacklevel=3,
            )
    teacher = cfg.distill.teacher_path
    if teacher is not None and is_checkpoint(teacher):  # a dockrl run's checkpoint: its hf/ export
        try:
            found["distill.teacher_path"] = resolve_model_path(teacher)
        except FileNotFoundError as exc:
            raise ConfigError(f"distill.teacher_path={teacher!r}: {exc}") from exc
    if cfg.critic.path is not None and is_checkpoint(cfg.critic.path):
        try:
            found["critic.path"] = resolve_critic_path(cfg.critic.path)
        except FileNotFoundError as exc:
            raise ConfigError(f"critic.path={cfg.critic.path!r}: {exc}") from exc
    return found


def _check_resume_path(cfg: TrainConfig) -> None:
    """A run.resume path must be a complete checkpoint."""
    from dockrl.checkpoint.directory import is_checkpoint

    run = cfg.run
    if run.resume not in ("never", "auto") and not is_checkpoint(run.resume):
        raise config_error(
            "run.resume",
            run.resume,
            "is not never, auto, or a complete checkpoint (a RUN_DIR/checkpoints/step_NNNNNN directory with "
            "trainer_state.json; a *.tmp directory is an interrupted save)",
            "use run.resume=auto, or the path of a complete checkpoint",
        )


def _check_reward_functions(cfg: TrainConfig) -> None:
    """Every reward function resolves (imports, and accepts its kwargs) here, not on the first sample."""
    from dockrl.rewards.base import resolve_reward_fn

    for i, spec in enumerate(cfg.reward.functions):
        try:
            resolve_reward_fn(spec.name, spec.kwargs, spec.code, spec.source_file)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"reward.functions[{i}].name={spec.name!r}: {exc}") from exc


def _check_environment(cfg: TrainConfig, model_path: str) -> None:
    """env.name: the environment class loads and builds with env.kwargs here, not in the rollout; the model's
    family has a tool-call format, and its tokenizer a chat template."""
    if cfg.env.name is None:
        return
    from dockrl.config.specs import env_spec
    from dockrl.envs.loader import factory_of, is_agent
    from dockrl.envs.tool_calls import tool_call_families
    from dockrl.models.config import read_config
    from dockrl.models.tokenizer import Tokenizer

    args = read_config(model_path)
    family = args.family
    if args.family_record.tool_call_format is None:
        raise config_error(
            "env.name",
            cfg.env.name,
            f"model family {family!r} has no tool-call format",
            f"use {tool_call_families()}",
        )
    if not cfg.data.use_chat_template or Tokenizer.from_dir(model_path).chat_template is None:
        raise config_error(
            "env.name",
            cfg.env.name,
            "multi-turn renders every observation with the tokenizer's chat template",
            "use a tokenizer with a chat template and data.use_chat_template=true",
        )
    spec = env_spec(cfg.env, cfg.data.system_prompt, cfg.rollout.max_new_tokens)
    try:
        if is_agent(spec):  # an agent function: its client is the `openai` package (dockrl[agents])
            import openai  # noqa: F401
        else:
            factory_of(spec, family)
    except ImportError as exc:
        raise config_error(
            "env.name",
            cfg.env.name,
            "an agent function needs the `openai` client",
            "pip install 'dockrl[agents]'",
        ) from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"env.name={cfg.env.name!r}: {exc}") from exc


def _check_dock_policy(cfg: TrainConfig) -> None:
    """dock.policy: a built-in (dockrl/dock/policies.py) or an importable 'module:function'."""
    dock = cfg.dock
    if dock.policy in ("first", "oldest"):
        return
    module, _, function = dock.policy.partition(":")
    try:
        found = bool(module and function) and callable(getattr(importlib.import_module(module), function))
    except (ImportError, AttributeError):
        found = False
    if not found:
        raise config_error(
            "dock.policy",
            dock.policy,
            "not a built-in policy and not an importable 'module:function'",
            "use first, oldest, or a function importable on every node",
        )


def _check_data_files(data: DataConfig) -> None:
    """The dataset files exist and hold the prompt (and label) field."""
    check_dataset(data.train_path, data.prompt_field, data.label_field, "data.train_path")
    if data.eval_path is not None:
        check_dataset(data.eval_path, data.prompt_field, data.label_field, "data.eval_path")


def _check_loggers(loggers: list[str]) -> None:
    """run.loggers: known names whose packages are installed (and W&B credentials unless offline)."""
    from dockrl.observe.loggers import logger_problem

    problem = logger_problem(loggers)
    if problem is not None:
        raise config_error("run.loggers", loggers, *problem)


def _check_devices(device: str, ranks: int) -> None:
    if device != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    if ranks > count:
        # On a multi-node cluster the driver sees only its own node; Ray places the rest.
        warnings.warn(
            f"the {ranks} GPU ranks (actor.dp x actor.cp x actor.tp, plus critic.dp x critic.cp with ppo and distill.num_workers with a teacher) exceed the {count} GPUs "
            "visible to the driver; Ray must find the rest",
            stacklevel=2,
        )


def _check_threads(device: str, threads_per_rank: int, ranks: int) -> None:
    """run.threads_per_rank on cpu: warn (never refuse) when the trainer ranks' threads, all running at once,
    exceed this machine's cores."""
    cores = os.cpu_count() or 1
    if device != "cpu" or threads_per_rank * ranks <= cores:
        return
    # The driver sees only its own node; ranks that placement.* puts on other nodes do not share its cores.
    warnings.warn(
        f"run.threads_per_rank={threads_per_rank} x {ranks} trainer ranks (actor.dp x actor.cp x actor.tp, plus "
        f"critic.dp x critic.cp with ppo and distill.num_workers with a teacher) = {threads_per_rank * ranks} "
        f"torch threads oversubscribe the {cores} cores of this machine: threads wait on each other at every "
        f"op; use run.threads_per_rank={max(1, cores // ranks)} or 0 (auto) unless you measured it faster",
        stacklevel=2,
    )


def _check_teacher(cfg: TrainConfig) -> None:
    """distill.teacher_path: a causal LM whose tokenizer gives every token the policy's id, whose embedding
    covers those ids, and whose shapes split over distill.tp."""
    from dockrl.models.config import read_config
    from dockrl.models.tokenizer import TOKENIZER_FILE, same_vocabulary
    from dockrl.models.tp_plan import tp_problem

    path = cfg.distill.teacher_path
    if path is None:
        return
    check_model_dir(path, "distill.teacher_path")
    if not (Path(path) / TOKENIZER_FILE).is_file():
        raise config_error(
            "distill.teacher_path",
            path,
            f"the directory has no {TOKENIZER_FILE} (the teacher's vocabulary must be checked against the "
            "policy's)",
            "pass a Hugging Face directory with its tokenizer",
        )
    if not same_vocabulary(cfg.model.path, path):
        raise config_error(
            "distill.teacher_path",
            path,
            f"its tokenizer maps tokens to other ids than the policy's (model.path={cfg.model.path}), and the "
            "teacher scores the policy's token ids as they are",
            "use a teacher of the policy's model family and tokenizer (the same token -> id map)",
        )
    teacher, policy = read_config(path), read_config(cfg.model.path)
    if teacher.vocab_size < policy.vocab_size:
        raise config_error(
            "distill.teacher_path",
            path,
            f"its embedding has {teacher.vocab_size} rows, fewer than the policy's vocab_size={policy.vocab_size}",
            "use a teacher whose vocab_size covers the policy's",
        )
    if cfg.distill.top_k > policy.vocab_size:
        raise config_error(
            "distill.top_k",
            cfg.distill.top_k,
            f"exceeds the policy's vocab_size={policy.vocab_size} (the top-k are among the policy's ids)",
            f"use a k in [1, {policy.vocab_size}] (tens of tokens hold nearly all of a teacher's mass), or 0",
        )
    if cfg.distill.cp > 1 and teacher.is_moe:
        raise config_error(
            "distill.cp",
            cfg.distill.cp,
            f"splits sequences, and context parallelism of MoE models (distill.teacher_path={path}) is not built",
            "use distill.cp=1 with a qwen3_moe teacher",
        )
    problem = tp_problem(teacher, cfg.distill.tp)
    if teacher.is_moe and cfg.distill.tp > 1:
        problem = "tensor parallelism of MoE layers is not built (a qwen3_moe teacher shards with FSDP2 only)"
    if problem is not None:
        raise config_error("distill.tp", cfg.distill.tp, problem, "set distill.tp to a valid size")


def _check_reward_model_files(cfg: TrainConfig) -> None:
    """reward.model: a one-output *ForSequenceClassification checkpoint with its tokenizer; GPUs to hold it."""
    rm = cfg.reward.model
    if rm.path is None:
        return
    from dockrl.models.classifier import check_reward_model_dir

    check_model_dir(rm.path, "reward.model.path")
    try:
        check_reward_model_dir(rm.path)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"reward.model.path={rm.path!r}: {exc}") from exc
    if not (Path(rm.path) / "tokenizer.json").is_file():
        raise config_error(
            "reward.model.path",
            rm.path,
            "the directory has no tokenizer.json (responses are re-tokenized when its vocabulary differs "
            "from the policy's)",
            "copy the reward model's tokenizer files into it",
        )
    if cfg.run.device == "cuda":
        import torch

        actor_ranks, count = cfg.actor.dp * cfg.actor.cp * cfg.actor.tp, torch.cuda.device_count()
        if actor_ranks + rm.num_workers > count:
            warnings.warn(
                f"{actor_ranks} actor ranks and reward.model.num_workers={rm.num_workers} each take a GPU; "
                f"the driver sees {count}, so Ray must find the rest on other nodes",
                stacklevel=3,
            )


def _check_model_layouts(cfg: TrainConfig) -> None:
    """The model's shapes against the training and rollout tp sizes and reshard.bucket_mb; the reshard
    offload flags against the resolved device."""
    from dockrl.models.config import read_config
    from dockrl.models.tp_plan import tp_problem

    actor, roll, reshard = cfg.actor, cfg.rollout, cfg.reshard
    args = read_config(cfg.model.path)
    if cfg.algo.routing_replay == "r3" and not args.is_moe:
        raise config_error(
            "algo.routing_replay",
            "r3",
            f"replays experts, and model.path={cfg.model.path} is a dense {args.family} model",
            "use algo.routing_replay=none, or a qwen3_moe model",
        )
    for key, value in (("actor.tp", actor.tp), ("rollout.tp", roll.tp)):
        problem = tp_problem(args, value)
        if problem is not None:
            raise config_error(key, value, problem, f"set {key} to a valid size")
    if actor.cp > 1 and args.is_moe:
        raise config_error(
            "actor.cp",
            actor.cp,
            f"splits sequences, and context parallelism of MoE models (model.path={cfg.model.path}) is not built",
            "use actor.cp=1 with a qwen3_moe model",
        )
    critic_path = cfg.critic.path or cfg.model.path
    if runs_critic(cfg.algo) and cfg.critic.cp > 1 and read_config(critic_path).is_moe:
        raise config_error(
            "critic.cp",
            cfg.critic.cp,
            f"splits sequences, and context parallelism of MoE models (the critic's {critic_path}) is not built",
            "use critic.cp=1 with a qwen3_moe critic",
        )
    if actor.ep > 1 and not args.is_moe:
        raise config_error(
            "actor.ep",
            actor.ep,
            f"splits experts, and model.path={cfg.model.path} is a dense {args.family} model",
            "use actor.ep=1, or a qwen3_moe model",
        )
    if args.is_moe and args.num_experts % actor.ep:
        divisors = [d for d in range(1, args.num_experts + 1) if args.num_experts % d == 0]
        raise config_error(
            "actor.ep",
            actor.ep,
            f"does not divide the model's num_experts={args.num_experts}",
            f"use one of {divisors} that also divides actor.dp",
        )
    _check_moe_lora(cfg, args)
    _check_vision(cfg, args)
    # the largest tensor: the embedding / LM head, a dense MLP matrix, or one MoE layer's fused experts
    numel = max(args.vocab_size, args.intermediate_size) * args.hidden_size
    if args.is_moe:
        numel = max(numel, args.num_experts * 2 * args.moe_intermediate_size * args.hidden_size)
    largest = 4 * numel  # fp32, the training dtype
    if reshard.bucket_mb is not None and reshard.bucket_mb * 2**20 < largest:
        raise config_error(
            "reshard.bucket_mb",
            reshard.bucket_mb,
            f"is smaller than the model's largest tensor ({largest / 2**20:.1f} MiB in fp32)",
            f"use reshard.bucket_mb >= {-(-largest // 2**20)} or None (automatic)",
        )
    if cfg.run.device == "cpu":
        for flag in ("offload_optimizer", "offload_grads", "offload_params"):
            if getattr(reshard, flag):
                warnings.warn(
                    f"reshard.{flag}=True has no effect on run.device=cpu: there is no device memory to free "
                    "(the switch runs the same code path and moves nothing)",
                    stacklevel=3,
                )


def _check_vision(cfg: TrainConfig, args) -> None:
    """A vision-language policy (model.path a qwen2_5_vl): what feeds its images is built for the single-turn
    actor's passes and dockrl's rollout; the rest is refused by name (docs/vision.md)."""
    from dockrl.config.step_plan import step_plan

    if args.vision is None:
        if not cfg.actor.vision.freeze:
            warnings.warn(
                f"actor.vision.freeze=False has no effect: model.path={cfg.model.path} has no vision tower",
                stacklevel=3,
            )
        return
    path = cfg.model.path
    refused = [
        (
            "actor.cp",
            cfg.actor.cp,
            cfg.actor.cp > 1,
            "splits sequences, and the multimodal positions and images of a split row are not built",
            "use actor.cp=1",
        ),
        (
            "rollout.partial",
            cfg.rollout.partial,
            cfg.rollout.partial,
            "carries cut rows to the next step without their images",
            "use rollout.partial=false",
        ),
        (
            "env.name",
            cfg.env.name,
            cfg.env.name is not None,
            "multi-turn rollouts render text observations and carry no images",
            "use a single-turn run (env.name=null)",
        ),
        (
            "distill.teacher_path",
            cfg.distill.teacher_path,
            cfg.distill.teacher_path is not None,
            "a teacher scores rows without their images",
            "use no teacher",
        ),
        (
            "reward.model.path",
            cfg.reward.model.path,
            cfg.reward.model.path is not None,
            "a reward model scores rows without their images",
            "use reward functions",
        ),
        (
            "algo.adv_estimator",
            cfg.algo.adv_estimator,
            step_plan(cfg).critic,
            "runs a critic, which reads rows without their images",
            "use a critic-free estimator (grpo, rloo, reinforce_pp, ...)",
        ),
    ]
    for key, value, bad, problem, fix in refused:
        if bad:
            raise config_error(key, value, f"{problem} (model.path={path} is a vision-language model)", fix)
    if not cfg.actor.vision.freeze and cfg.actor.lora.rank > 0:
        raise config_error(
            "actor.vision.freeze",
            False,
            "trains the vision tower, and with actor.lora.rank > 0 every base weight is frozen (adapters go on "
            "the language model only)",
            "use actor.vision.freeze=true with LoRA, or actor.lora.rank=0",
        )


def _check_moe_lora(cfg: TrainConfig, args) -> None:
    """LoRA adapters on MoE models go on the attention (and dense MLP layers): experts take none (not built),
    so naming the MLP projections on an MoE model is refused rather than adapting only its dense layers."""
    lora = cfg.actor.lora
    if lora.rank == 0 or not args.is_moe or lora.target_modules in (None, ALL_LINEAR):
        return
    targets = [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules)
    mlp = [t for t in targets if t in MLP_LINEARS]
    if mlp:
        raise config_error(
            "actor.lora.target_modules",
            targets,
            f"names MLP projections {mlp}, and model.path={cfg.model.path} routes its MLPs to experts: LoRA on "
            "experts is not built (the experts and routers stay frozen)",
            "target the attention, [q_proj, k_proj, v_proj, o_proj] (all-linear adapts attention and any dense "
            "MLP layers)",
        )


def _check_backend(cfg: TrainConfig) -> None:
    """rollout.backend: installed here, and able to serve the model on this device (its own checks,
    backends)."""
    from dockrl.backends import backend
    from dockrl.models.config import read_config

    name = cfg.rollout.backend
    entry = backend(name)
    problem = entry.install_problem()
    if problem is not None:
        raise config_error("rollout.backend", name, problem, "install it, or use rollout.backend=dockrl")
    problem = entry.model_problem(read_config(cfg.model.path), cfg.run.device)
    if problem is not None:
        raise config_error(
            "rollout.backend",
            name,
            f"model.path={cfg.model.path}: {problem}",
            "or pick a model it serves",
        )
