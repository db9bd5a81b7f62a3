"""Model architecture arguments of the families in models/families/ (Llama, Qwen2, Qwen3, Qwen3-MoE).

`ModelArgs` is the one description of a decoder's shape. It converts from and to a Hugging Face
`config.json` dict so that dockrl checkpoints load in transformers as the matching `*ForCausalLM` and
Hugging Face checkpoints load in dockrl. Per-family invariants that Hugging Face hard-codes (Qwen2 always has
q/k/v bias, Qwen3 always has per-head q/k RMSNorm), read from the family's record, are checked when the args
are built, so a `ModelArgs` that passes validation always describes a model transformers can build with
identical parameters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dockrl.models.families import FAMILIES, Family, family_named, family_of

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
_DIR_CONTENTS = (
    f"a model directory must contain {CONFIG_FILE} and either {WEIGHTS_FILE} or "
    f"model-0000x-of-0000y.safetensors shards with {WEIGHTS_INDEX_FILE}"
)

SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass
class ModelArgs:
    """Shape and numerics of one decoder-only transformer (see module docstring)."""

    family: str
    """Architecture family: a name registered in models/families/ (e.g. "llama", "qwen2", "qwen3_moe")."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual stream width H."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA); divides num_heads."""
    head_dim: int
    """Width of one attention head (need not equal hidden_size / num_heads, e.g. Qwen3)."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    rope_scaling: dict | None = None
    """Hugging Face rope_scaling dict; rope_type "llama3" or "default"/None are supported."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + response) the model accepts."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding weight (no separate lm_head parameter)."""
    attention_bias: bool = False
    """Bias on q/k/v (and o for llama/qwen3, as in Hugging Face); always True for qwen2
    (`Family.qkv_bias`)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE; True exactly for qwen3 and qwen3_moe (`Family.qk_norm`)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, carried to and from config.json."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token(s), carried to and from config.json."""
    pad_token_id: int | None = None
    """Padding token, carried to and from config.json."""
    num_experts: int = 0
    """Mixture of experts (qwen3_moe): experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (the router's top-k)."""
    moe_intermediate_size: int = 0
    """Width of one expert's SwiGLU MLP."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE does)."""
    decoder_sparse_step: int = 1
    """Layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP of intermediate_size."""
    router_aux_loss_coef: float = 0.001
    """Weight of the router's load-balancing loss in Hugging Face's config (dockrl logs its loss; actor.moe_aux_loss_coef weighs it in)."""

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        self._validate_shape()
        self._validate_family()
        self._validate_moe()
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    @property
    def family_record(self) -> Family:
        """The record of `family` (models/families/)."""
        return family_named(self.family)

    def _validate_shape(self) -> None:
        family_named(self.family)  # raises for a family that is not registered
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name}={getattr(self, name)} must be >= 1")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}; "
                "use a divisor of num_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"model head_dim={self.head_dim} must be even for RoPE")

    def _validate_family(self) -> None:
        family = self.family_record
        if family.qkv_bias and not self.attention_bias:
            raise ValueError(
                f"model family={self.family!r} always has q/k/v bias in Hugging Face; set attention_bias=True"
            )
        if self.qk_norm != family.qk_norm:
            with_norm = " and ".join(f.name for f in FAMILIES.values() if f.qk_norm)
            raise ValueError(
                f"model qk_norm={self.qk_norm} does not match family={self.family!r}: "
                f"Hugging Face applies q/k RMSNorm exactly for {with_norm}; set qk_norm={family.qk_norm}"
            )

    def _validate_moe(self) -> None:
        if self.family_record.moe != (self.num_experts > 0):
            with_experts = " or ".join(f"family={f.name!r}" for f in FAMILIES.values() if f.moe)
            raise ValueError(
                f"model family={self.family!r} with num_experts={self.num_experts}: experts come with "
                f"{with_experts} (num_experts >= 2) and only with it"
            )
        if not self.is_moe:
            return
        if self.num_experts < 2 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}: use "
                "num_experts >= 2 and 1 <= num_experts_per_tok <= num_experts"
            )
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(
                f"model moe_intermediate_size={self.moe_intermediate_size}, decoder_sparse_step="
                f"{self.decoder_sparse_step} must be >= 1"
            )

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has experts (Hugging Face Qwen3-MoE's rule)."""
        return (
            self.is_moe and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers, in order."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def rope_type(self) -> str:
        """ "default" or "llama3"."""
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: Hugging Face Qwen2 biases q/k/v only, Llama and Qwen3 all four."""
        return self.attention_bias and self.family_record.o_proj_bias

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        """Build args from a Hugging Face config.json dict (a model_type of a family's `hf_model_types`).

        Accepts both the legacy rope layout (top-level `rope_theta` + `rope_scaling`) and transformers 5's
        `rope_parameters`. Raises ValueError for a model_type or a feature dockrl does not implement.
        """
        family = family_of(cfg)
        _reject_unsupported_features(cfg, family)
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(cfg)
        return cls(
            family=family.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=True if family.qkv_bias else cfg.get("attention_bias", False),
            qk_norm=family.qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            **_read_moe(cfg, family),
        )

    def to_hf_config(self) -> dict:
        """A config.json dict that transformers loads as the matching *ForCausalLM with identical params.

        Rope is written in both layouts: `rope_parameters` (transformers >= 5) and the legacy `rope_theta` +
        `rope_scaling` read by older transformers and by inference engines.
        """
        family = self.family_record
        cfg: dict[str, Any] = {
            "architectures": [family.causal_lm],
            "model_type": self.family,
            "torch_dtype": "float32",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "rope_parameters": {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
            | (self.rope_scaling or {}),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        cfg.update(family.hf_fixed)
        if self.is_moe:
            cfg.update(
                num_experts=self.num_experts,
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=False,
            )
        return cfg

    def num_params(self) -> int:
        """Number of parameters of the model these args describe (tied embeddings counted once)."""
        hidden, q_width, kv_width = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        if self.o_proj_bias:
            attention += hidden
        if self.qk_norm:
            attention += 2 * self.head_dim
        dense_mlp = 3 * hidden * self.intermediate_size
        moe_mlp = self.num_experts * (
            3 * hidden * self.moe_intermediate_size + hidden
        )  # experts + router row
        mlps = sum(moe_mlp if self.is_moe_layer(i) else dense_mlp for i in range(self.num_layers))
        per_layer = attention + 2 * hidden
        embedding = self.vocab_size * hidden
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * hidden
        return embedding + self.num_layers * per_layer + mlps + hidden + lm_head

    def to_dict(self) -> dict:
        """Plain dict of the fields (for logs and checkpoints metadata)."""
        return asdict(self)


def _reject_unsupported_features(cfg: dict, family: Family) -> None:
    """Raise for config.json settings that change the architecture in ways dockrl does not implement."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={cfg['hidden_act']!r} is not supported; only 'silu' is")
    if cfg.get("mlp_bias", False):
        raise ValueError("config.json mlp_bias=True is not supported; only bias-free MLPs are")
    key = family.sliding_window_key
    if key is not None and cfg.get(key) not in (None, False):
        raise ValueError(
            f"config.json {key}={cfg[key]} is not supported for model_type={cfg['model_type']!r}; "
            f"only full attention is ({key}: null or false)"
        )


def _read_moe(cfg: dict, family: Family) -> dict[str, Any]:
    """The MoE fields of a qwen3_moe config.json ({} for a dense family)."""
    if not family.moe:
        return {}
    return {
        # transformers 5 writes num_local_experts; the hub's Qwen3-MoE configs (and vLLM) say num_experts
        "num_experts": cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"],
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "norm_topk_prob": cfg.get("norm_topk_prob", True),
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": cfg.get("router_aux_loss_coef", 0.001),
    }


def _read_rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either rope layout of a config.json dict."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope_theta = cfg.get("rope_theta")
    if params is not None:
        params = dict(params)
        rope_theta = params.pop("rope_theta", rope_theta)
        if params.pop("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "config.json partial_rotary_factor != 1.0 is not supported; only full-head RoPE is"
            )
    return (10000.0 if rope_theta is None else float(rope_theta)), params


def _normalize_rope_scaling(rope_scaling: dict | None, max_position_embeddings: int) -> dict | None:
    """None for plain RoPE, else a copy with `rope_type` set (legacy configs spell it `type`).

    A llama3 dict without original_max_position_embeddings gets max_position_embeddings, as transformers does.
    """
    if rope_scaling is None:
        return None
    scaling = dict(rope_scaling)
    rope_type = scaling.pop("type", None)
    scaling.setdefault("rope_type", rope_type or "default")
    if scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model rope_scaling rope_type={scaling['rope_type']!r} is not supported; "
            f"use one of {SUPPORTED_ROPE_TYPES} or rope_scaling=None"
        )
    if scaling["rope_type"] == "default":
        extra = set(scaling) - {"rope_type"}
        if extra:
            raise ValueError(
                f"model rope_scaling with rope_type='default' has unsupported keys {sorted(extra)}"
            )
        return None
    scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    missing = [key for key in _LLAMA3_ROPE_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"model rope_scaling rope_type='llama3' is missing {missing}")
    return scaling


def read_config(path: str | Path) -> ModelArgs:
    """Read ``config.json`` of the model directory ``path`` into ``ModelArgs``."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {path} does not exist or is not a directory; {_DIR_CONTENTS}"
        )
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in model directory {path}; {_DIR_CONTENTS}")
    with open(config_file, encoding="utf-8") as f:
        return ModelArgs.from_hf_config(json.load(f))
