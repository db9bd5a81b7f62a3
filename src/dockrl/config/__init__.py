"""Typed configs: schema, YAML loading with dotted overrides, validation before any process starts."""

from dockrl.config.fields import ConfigError
from dockrl.config.loader import apply_override, from_dict, load_config, render_docs, to_dict
from dockrl.config.schema import (
    ActorConfig,
    AlgoConfig,
    CriticConfig,
    DataConfig,
    DockConfig,
    ModelConfig,
    RewardConfig,
    RewardFnConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    SFTRunConfig,
    TrainConfig,
)
from dockrl.config.validate import resolve_device, resolve_precision, validate_sft, validate_train

__all__ = [
    "ActorConfig",
    "AlgoConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DockConfig",
    "ModelConfig",
    "RewardConfig",
    "RewardFnConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SFTRunConfig",
    "TrainConfig",
    "apply_override",
    "from_dict",
    "load_config",
    "render_docs",
    "resolve_device",
    "resolve_precision",
    "to_dict",
    "validate_sft",
    "validate_train",
]
