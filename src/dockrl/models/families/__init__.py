"""Model families as records: one file per family, each registering one `Family` (record.py).

    llama.py  qwen2.py  qwen2_5_vl.py  qwen3.py  qwen3_moe.py    each: FAMILY = register(Family(name=..., ...))
        |         |           |           |          |
        +---------+-----------+-----------+----------+--> FAMILIES (name -> Family), read through
                                               family_named(name), family_of(config.json dict), LINEAR_NAMES

Who reads the records: models/config.py (ModelArgs: what config.json holds and what the family requires),
models/classifier.py (reward models' class names), models/tiny.py (make-tiny), envs/tool_calls.py (tool-call
format), config/ (LoRA's layer names) and cli.py (make-tiny's --family choices).

A family whose layers dockrl's decoder already builds (a Llama-like one) is one new file: copy llama.py to
<name>.py, fill in its record, and add <name> to the import line below; tests/unit/test_families.py then
checks that the file is registered, that its config.json round-trips and that make-tiny builds it. A family
with new layers also needs them in models/decoder.py (and models/hf.py, models/tp_plan.py where its tensors
differ). A family with a vision tower (qwen2_5_vl) also has models/vision.py and the multimodal positions
in the decoder (docs/vision.md).

Imports no torch and no Ray: config/ reads it before any worker starts.
"""

from collections.abc import Mapping, Sequence

from dockrl.errors import ConfigError

# Each family file registers its record when imported: a new family is one more name on this line.
from dockrl.models.families import llama, qwen2, qwen2_5_vl, qwen3, qwen3_moe  # noqa: F401
from dockrl.models.families.record import (
    ATTENTION_LINEARS,
    FAMILIES,
    MLP_LINEARS,
    Family,
    TinyPreset,
    ToolCallFormat,
    register,
)

ALL_LINEAR = "all-linear"
"""PEFT's name for every linear layer of the model (the LM head excepted)."""
LINEAR_NAMES = tuple(dict.fromkeys(name for family in FAMILIES.values() for name in family.linear_names))
"""The linear layers that take LoRA adapters, over every family, in the decoder's order: what
actor.lora.target_modules may name (the config is checked before the model is read)."""


def family_named(name: str) -> Family:
    """The family `name` (`ModelArgs.family`); raises ValueError naming the registered ones."""
    if name not in FAMILIES:
        raise ValueError(f"model family={name!r} is not supported; use one of {tuple(FAMILIES)}")
    return FAMILIES[name]


def family_of(hf_config: Mapping) -> Family:
    """The family a Hugging Face config.json dict belongs to, by its model_type; raises ValueError naming the
    model types dockrl reads."""
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = tuple(t for family in FAMILIES.values() for t in family.hf_model_types)
    raise ValueError(f"config.json model_type={model_type!r} is not supported; use one of {known}")


def linear_targets(target_modules: str | Sequence[str], key: str) -> tuple[str, ...]:
    """`all-linear` or a list of short layer names -> the names adapted, in the decoder's order; raises a
    ConfigError naming `key`, each name that matches no linear layer, and the names that do."""
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            raise ConfigError(
                f"{key}={target_modules!r}: is neither a list nor {ALL_LINEAR}; "
                f"use {ALL_LINEAR} or a list of {list(LINEAR_NAMES)}"
            )
        return LINEAR_NAMES
    unknown = [name for name in target_modules if name not in LINEAR_NAMES]
    if unknown or not target_modules:
        raise ConfigError(
            f"{key}={list(target_modules)!r}: names {unknown or 'no layer'}; "
            f"the model's linear layers are {list(LINEAR_NAMES)} (or use {ALL_LINEAR})"
        )
    return tuple(name for name in LINEAR_NAMES if name in target_modules)


__all__ = [
    "ALL_LINEAR",
    "ATTENTION_LINEARS",
    "FAMILIES",
    "LINEAR_NAMES",
    "MLP_LINEARS",
    "Family",
    "TinyPreset",
    "ToolCallFormat",
    "family_named",
    "family_of",
    "linear_targets",
    "register",
]
