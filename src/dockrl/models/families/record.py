"""What a model family is: the `Family` record every file of this package fills in, and `register`.

A family is an architecture dockrl's one decoder (models/decoder.py) builds with the same parameters and
logits as transformers' classes of that name. The record holds only facts: names Hugging Face uses, switches
the decoder reads (biases, q/k norms, experts), how the family writes tool calls, and what `make-tiny`
builds. No torch and no Ray here: config/ reads the registry before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

ToolCallFormat = Literal["qwen", "llama"]
"""Tool-call formats envs/tool_calls.py parses (its module docstring shows each)."""

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The attention's linear layers, as Hugging Face names them."""
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
"""A dense SwiGLU MLP's linear layers (an MoE layer has none: its experts are 3-D parameters)."""


@dataclass(frozen=True)
class TinyPreset:
    """What `make_tiny` (`dockrl make-tiny --family NAME`) builds of a family beyond the shape all share: the
    choices of the family's small hub checkpoints."""

    tie_word_embeddings: bool
    """LM head shares the embedding weight (Qwen2.5-0.5B and Qwen3-0.6B do, Llama 3 does not)."""
    attention_bias: bool
    """Bias on the attention's projections (required where `Family.qkv_bias`)."""


@dataclass(frozen=True)
class Family:
    """One architecture family: its Hugging Face names and the facts the decoder, config checks, reward
    models, tool-call parsing and make-tiny read (module docstring). `ModelArgs.family` holds `name`."""

    name: str
    """dockrl's name of the family, and the config.json model_type it writes."""
    hf_model_types: tuple[str, ...]
    """config.json model_type values read as this family, `name` first (mistral without a sliding window is a
    llama)."""
    causal_lm: str
    """transformers' causal-LM class, written as config.json's `architectures`."""
    seq_cls: str | None
    """transformers' sequence-classification class (a reward model's `architectures`); None: dockrl reads and
    writes no reward model of this family."""
    qkv_bias: bool
    """q/k/v always have a bias and config.json's attention_bias is not read (Hugging Face hard-codes it:
    Qwen2). False: attention_bias says."""
    o_proj_bias: bool
    """o_proj has a bias whenever q/k/v do (Llama, Qwen3: attention_bias covers all four; Qwen2: q/k/v
    only)."""
    qk_norm: bool
    """Per-head RMSNorm on q and k before RoPE (Qwen3); a model of the family has it exactly when this is
    True."""
    moe: bool
    """Layers route tokens to experts (Qwen3-MoE's config keys and layer rule, models/moe.py); a model of the
    family has experts exactly when this is True."""
    sliding_window_key: str | None
    """config.json key that switches sliding-window attention on (a true flag or a window width: refused, as
    dockrl has full attention only); None: the family has none."""
    hf_fixed: Mapping[str, object] = field(hash=False)
    """config.json keys written with the one value dockrl supports, for transformers (on reading, dockrl's
    checks refuse the values it does not support)."""
    tool_call_format: ToolCallFormat | None
    """How the family's chat template writes tool calls (multi-turn environments parse them); None: no
    environment runs on it."""
    tiny: TinyPreset
    """What make-tiny builds of it."""
    vision: bool = False
    """The model has a vision tower and multimodal RoPE (Qwen2.5-VL: models/vision.py); a model of the family
    has one exactly when this is True."""
    linear_names: tuple[str, ...] = ATTENTION_LINEARS + MLP_LINEARS
    """The decoder's linear layers of this family that take LoRA adapters (never the LM head or a router)."""


_REGISTRY: dict[str, Family] = {}
FAMILIES: Mapping[str, Family] = MappingProxyType(_REGISTRY)
"""Every registered family by name, in registration order (read-only; `register` adds)."""


def register(family: Family) -> Family:
    """Add `family` to the registry (dockrl.models.families.FAMILIES) and return it; each family file calls
    it once. Raises ValueError when its name or a model type is already taken, or its record contradicts
    itself."""
    if family.hf_model_types[:1] != (family.name,):
        raise ValueError(
            f"family {family.name!r}: hf_model_types={family.hf_model_types} must start with its name"
        )
    if family.qkv_bias and not family.tiny.attention_bias:
        raise ValueError(
            f"family {family.name!r} always has q/k/v bias: its tiny preset needs attention_bias=True"
        )
    taken = {t for f in _REGISTRY.values() for t in f.hf_model_types}
    clashes = [t for t in family.hf_model_types if t in taken]
    if family.name in _REGISTRY or clashes:
        raise ValueError(f"family {family.name!r}: name or model types {clashes} are already registered")
    _REGISTRY[family.name] = family
    return family
