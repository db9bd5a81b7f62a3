"""Typed configs for every dockrl job. Each field is documented once, where it is declared.

A job config is a tree of dataclasses: `TrainConfig` for `dockrl train` (GRPO), `SFTConfig` for `dockrl sft`.
Load one from YAML with dotted overrides via `dockrl.config.load_config`; validation (`validate_train`,
`validate_sft`) runs before Ray or any process starts.

The sections are declared by concept: here the jobs and their inputs (model, data, rewards);
training_schema.py what is trained and towards what objective (optimizer, actor, algorithm, critic,
distillation); run_schema.py how the run executes (rollout, reshard, dock, run, placement, environment). Every
section is importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dockrl.config.fields import required, setting
from dockrl.config.run_schema import (
    Device,
    DockConfig,
    DockMode,
    DockTransport,
    EnvConfig,
    PlacementConfig,
    Precision,
    ReshardConfig,
    RolloutConfig,
    RunConfig,
)
from dockrl.config.training_schema import (
    FSDP_UNIT_PARAMS,
    ActorConfig,
    AlgoConfig,
    CriticConfig,
    DistillConfig,
    LoraConfig,
    OptimConfig,
    VisionConfig,
)
from dockrl.models.families import FAMILIES

__all__ = [
    "FSDP_UNIT_PARAMS",
    "ActorConfig",
    "AlgoConfig",
    "CriticConfig",
    "DataConfig",
    "Device",
    "DistillConfig",
    "DockConfig",
    "DockMode",
    "DockTransport",
    "EnvConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "PlacementConfig",
    "Precision",
    "ReshardConfig",
    "RewardConfig",
    "RewardFnConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SFTRunConfig",
    "TrainConfig",
    "VisionConfig",
]


@dataclass
class ModelConfig:
    """The policy model."""

    path: str = required(
        "Hugging Face checkpoint directory (config.json, *.safetensors, single or sharded, and tokenizer "
        "files), or a dockrl checkpoint root RUN_DIR/checkpoints/step_NNNNNN (its hf/ export is loaded)."
    )
    ref_path: str | None = setting(
        None,
        "Reference model directory for the KL term; None uses `model.path`, or, when `model.path` is a "
        "checkpoint root, the reference that checkpoint's run used (the KL reference never moves silently).",
    )
    lora_path: str | None = setting(
        None,
        "A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start the actor's "
        "adapters from; its rank, alpha and targets are the run's (actor.lora keys left unset or equal).",
    )


@dataclass
class DataConfig:
    """Prompt datasets."""

    train_path: str = required("Training prompts: a .jsonl, .json (json lines) or .parquet file.")
    prompt_field: str = setting(
        "prompt", "Field holding the prompt: a string or a list of chat messages {role, content}."
    )
    label_field: str = setting(
        "answer", "Field holding the ground truth passed to reward functions as `label`."
    )
    eval_path: str | None = setting(
        None,
        "Held-out prompts (optional): `dockrl train` scores greedy answers, `dockrl sft` reports the teacher-"
        "forced answer loss and token accuracy at the end.",
    )
    eval_limit: int | None = setting(None, "Score at most this many held-out prompts.")
    system_prompt: str | None = setting(None, "System message prepended to every prompt.")
    use_chat_template: bool = setting(
        True, "Render prompts with the tokenizer's chat template (False: the raw prompt text)."
    )
    max_prompt_len: int = setting(
        512, "Prompts longer than this many tokens are skipped (counted in the log)."
    )
    shuffle: bool = setting(True, "Shuffle the training prompts each epoch (seeded by `run.seed`).")
    tools: list[str] = setting(
        [],
        "dockrl sft on tool-use conversations: built-in tools (calculator, python) whose schemas the chat "
        "template renders into each prompt, as env.name=tools does in `dockrl train`.",
    )


@dataclass
class RewardFnConfig:
    """One reward function and its weight."""

    name: str = required(
        "A built-in (exact_answer, math_verify, format), `package.module:function`, or a file "
        "`path/to/file.py:function` (relative to the config file's directory, then the working directory; a "
        "`module:function` whose module.py lies there works too): its source is read when the config is loaded "
        "and shipped to every reward worker and process, so it need not be on PYTHONPATH or on other nodes."
    )
    weight: float = setting(1.0, "Weight of this function's score in the total reward.")
    kwargs: dict = setting({}, "Keyword arguments passed to the function.")
    source_file: str | None = setting(
        None,
        "Filled in when the config is loaded: the file a file-given function was read from (leave unset).",
    )
    code: str | None = setting(
        None,
        "Filled in when the config is loaded: that file's source, recorded in the run's config (leave unset).",
    )


@dataclass
class RewardModelConfig:
    """A reward model scored by RewardModelWorkers; its weighted score joins the rule rewards."""

    path: str | None = setting(
        None,
        f"Hugging Face {' / '.join(f.seq_cls for f in FAMILIES.values() if f.seq_cls)} directory with "
        "num_labels=1 and its tokenizer (`dockrl make-tiny DIR --reward-model` builds a tiny one); None: no "
        "reward model.",
    )
    weight: float = setting(1.0, "Weight of the model's score in the total reward (stored as `reward/rm`).")
    num_workers: int = setting(
        1, "RewardModelWorker actors, each with the whole model (one GPU each on run.device=cuda)."
    )
    micro_batch_size: int = setting(8, "Sequences (prompt + response) per forward pass of the reward model.")


@dataclass
class RewardConfig:
    """Reward computation (CPU RewardWorkers, and RewardModelWorkers when `reward.model.path` is set)."""

    functions: list[RewardFnConfig] = field(
        default_factory=lambda: [RewardFnConfig(name="exact_answer")],
        metadata={
            "doc": "Reward functions; the total reward is their weighted sum (plus reward.model.weight x the "
            "reward model's score). May be [] when reward.model.path is set."
        },
    )
    model: RewardModelConfig = field(
        default_factory=RewardModelConfig,
        metadata={"doc": "Reward model (off unless reward.model.path is set)."},
    )
    num_workers: int = setting(1, "RewardWorker actors; each pulls whole groups from the dock.")
    num_processes: int = setting(
        1, "Processes per RewardWorker that run reward calls; 0 runs them inline (no timeout)."
    )
    inline: Literal["cheap", "all", "none"] = setting(
        "cheap",
        "Which reward functions run in the RewardWorker's own thread instead of its process pool (no pipe round "
        "trip per call): cheap, the built-ins that are pure Python and fast (exact_answer; format with its own "
        "pattern, not a configured one, which could backtrack for ever) and user functions that declare "
        "`fn.cheap = True`; all, every function; none, none. An inline call past reward.timeout_s stops the run "
        "with an error naming the function (a thread cannot be killed; a call stuck in C code that holds the GIL "
        "is not bounded at all): a function that can hang belongs in the pool.",
        noun="mode",
    )
    timeout_s: float = setting(
        5.0,
        "A reward call running longer is stopped and counted in `reward/timeouts`; reward.on_error says what "
        "its row then counts as. A timeout depends on wall time: a run is repeatable bit for bit only while "
        "reward/timeouts stays 0.",
    )
    on_error: Literal["zero", "drop_group"] = setting(
        "drop_group",
        "A reward call that timed out or raised: drop_group leaves the row's whole group out of the update "
        "(its tokens are masked out of the loss; counted in reward/dropped_groups), so a failure never counts "
        "as a wrong answer in its group's statistics; zero scores the call 0 and keeps the group.",
        noun="policy",
    )
    groups_per_pull: int = setting(
        4, "Groups a RewardWorker (and a RewardModelWorker) pulls from the dock at a time."
    )


@dataclass
class TrainConfig:
    """`dockrl train`: a GRPO job."""

    model: ModelConfig
    data: DataConfig
    run: RunConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dock: DockConfig = field(default_factory=DockConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # used only with algo.name=ppo
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn rollout when env.name is set
    distill: DistillConfig = field(
        default_factory=DistillConfig
    )  # a teacher when distill.teacher_path is set


@dataclass
class SFTRunConfig:
    """The SFT run."""

    epochs: float = setting(1.0, "Passes over the training file (fractions allowed).")
    batch_size: int = setting(32, "Examples per optimizer step.")
    seed: int = setting(0, "Seed for data order.")
    output_dir: str = setting("runs", "Parent directory of run directories.")
    name: str | None = setting(None, "Run directory name; None uses a timestamp.")
    max_len: int = setting(512, "Examples longer than this many tokens (prompt + answer) are skipped.")
    device: Device = setting("auto", "cpu, cuda or auto.", noun="device")
    precision: Precision = setting("auto", "fp32, bf16 or auto (as for train).", noun="precision")
    progress: bool = setting(True, "Show a progress bar on the console.")
    loggers: list[str] = setting(
        ["jsonl"],
        "Where each step's metrics go: jsonl (always on), tensorboard, wandb, mlflow (as for train).",
    )


@dataclass
class SFTConfig:
    """`dockrl sft`: supervised fine-tuning on prompt/answer pairs, loss on answer tokens only."""

    model: ModelConfig
    data: DataConfig
    run: SFTRunConfig = field(default_factory=SFTRunConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-3, micro_batch_size=32))
