"""Typed configs: schema, YAML loading with dotted overrides, algorithm presets, pure rules, and the resolved
config (with its step plan) that recipes and workers read. Imports no other dockrl package but dockrl.errors and
the torch-free registries below it: the algorithm registry (algos/registry.py: presets, estimators and their
traits, LossPlan), the model families (models/families/) and the rollout backends (backends/).

    load_config(TrainConfig, path, overrides) ─▶ check_train(cfg) ─▶ [recipes/preflight.py: files, devices]
                                              ─▶ resolve(cfg, found) -> Resolved(cfg copy, plan), frozen
"""

from dockrl.algos.registry import ALGORITHMS, PRESETS, LossPlan, Preset
from dockrl.config.fields import ConfigError
from dockrl.config.loader import apply_override, from_dict, load_config, render_docs, to_dict
from dockrl.config.resolve import Resolved, copy_with, resolve
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
    VisionConfig,
)
from dockrl.config.step_plan import StepPlan, loss_plan, step_plan
from dockrl.config.validate import check_sft, check_train

__all__ = [
    "ALGORITHMS",
    "PRESETS",
    "ActorConfig",
    "AlgoConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DockConfig",
    "LossPlan",
    "ModelConfig",
    "Preset",
    "Resolved",
    "RewardConfig",
    "RewardFnConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SFTRunConfig",
    "StepPlan",
    "TrainConfig",
    "VisionConfig",
    "apply_override",
    "check_sft",
    "check_train",
    "from_dict",
    "load_config",
    "loss_plan",
    "render_docs",
    "resolve",
    "copy_with",
    "step_plan",
    "to_dict",
]
