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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
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
VISION_TOKENS = ("image", "video", "vision_start", "vision_end")
"""A vision model's special tokens, config.json's `<name>_token_id`."""
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass(frozen=True)
class VisionArgs:
    """Shape of a Qwen2.5-VL vision tower (config.json's vision_config; transformers' names in brackets)."""

    depth: int
    """Vision blocks."""
    hidden_size: int
    """Width E of the vision blocks."""
    intermediate_size: int
    """Width of a block's SwiGLU MLP."""
    num_heads: int
    """Attention heads per block; head dim D = hidden_size / num_heads, a multiple of 4 (2-D rotary)."""
    out_hidden_size: int
    """Width of the merger's output: the language model's hidden size."""
    patch_size: int = 14
    """Side of a patch in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch."""
    spatial_merge_size: int = 2
    """Side m of the window of patches the merger folds into one token."""
    window_size: int = 112
    """Side of an attention window in pixels (a multiple of patch_size * spatial_merge_size)."""
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    """Blocks that attend over the whole image instead of a window."""
    in_channels: int = 3
    """Colour channels."""
    tokens_per_second: int = 2
    """Video time scale of the temporal position (carried to config.json; dockrl reads images only)."""
    rope_theta: float = 10000.0
    """Base wavelength of the 2-D rotary."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision_config hidden_size={self.hidden_size}, num_heads={self.num_heads}: the head dim must be "
                "an integer multiple of 4 (2-D rotary over h and w)"
            )
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size % unit:
            raise ValueError(
                f"vision_config window_size={self.window_size} must be a multiple of patch_size * "
                f"spatial_merge_size = {unit}"
            )

    @property
    def head_dim(self) -> int:
        """Width D of one vision attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch (channels x frames x patch x patch)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    def num_params(self) -> int:
        """Parameters of the tower these args describe."""
        e, i, merged = self.hidden_size, self.intermediate_size, self.hidden_size * self.spatial_merge_size**2
        block = 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (2 * e * i + 2 * i) + (i * e + e)
        merger = e + merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        return self.patch_dim * e + self.depth * block + merger

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> VisionArgs:
        """From config.json's vision_config dict; raises ValueError for what dockrl does not implement."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"vision_config hidden_act={cfg['hidden_act']!r} is not supported; only 'silu' is"
            )
        rope = cfg.get("rope_parameters") or {}
        return cls(
            depth=cfg["depth"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=cfg["num_heads"],
            out_hidden_size=cfg["out_hidden_size"],
            patch_size=cfg.get("patch_size", 14),
            temporal_patch_size=cfg.get("temporal_patch_size", 2),
            spatial_merge_size=cfg.get("spatial_merge_size", 2),
            window_size=cfg.get("window_size", 112),
            fullatt_block_indexes=tuple(cfg.get("fullatt_block_indexes", (7, 15, 23, 31))),
            in_channels=cfg.get("in_channels", 3),
            tokens_per_second=cfg.get("tokens_per_second", 2),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    def to_hf_config(self) -> dict:
        """config.json's vision_config dict (transformers' Qwen2_5_VLVisionConfig keys)."""
        return {
            "model_type": "qwen2_5_vl",
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "hidden_act": "silu",
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "tokens_per_second": self.tokens_per_second,
            "window_size": self.window_size,
            "out_hidden_size": self.out_hidden_size,
            "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }


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
    vision: VisionArgs | None = None
    """The vision tower (qwen2_5_vl, `Family.vision`); None for a text-only model."""
    mrope_section: tuple[int, ...] | None = None
    """Multimodal RoPE (qwen2_5_vl): the head's D/2 frequencies split into chunks that rotate by the temporal,
    height and width position streams in turn (sums to head_dim / 2); None: one position stream."""
    vision_token_ids: dict[str, int] = field(default_factory=dict)
    """image (<|image_pad|>), video, vision_start and vision_end token ids of a vision model (config.json's
    `<name>_token_id`)."""

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        self._validate_shape()
        self._validate_family()
        self._validate_moe()
        self._validate_vision()
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

    def _validate_vision(self) -> None:
        if isinstance(self.vision, Mapping):  # ModelArgs(**asdict(args)) round trips
            self.vision = VisionArgs(**self.vision)
        if self.mrope_section is not None:
            self.mrope_section = tuple(self.mrope_section)
        if self.family_record.vision != (self.vision is not None):
            raise ValueError(
                f"model family={self.family!r} with vision={self.vision is not None}: a vision tower comes "
                f"with the families {[f.name for f in FAMILIES.values() if f.vision]} and only with them"
            )
        if self.vision is None:
            return
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(
                f"vision_config out_hidden_size={self.vision.out_hidden_size} must equal the language model's "
                f"hidden_size={self.hidden_size}"
            )
        if self.mrope_section is None or 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(
                f"model mrope_section={self.mrope_section} must sum to head_dim / 2 = {self.head_dim // 2}"
            )
        missing = [n for n in VISION_TOKENS if not 0 <= self.vision_token_ids.get(n, -1) < self.vocab_size]
        if missing:
            raise ValueError(
                f"model vision_token_ids={self.vision_token_ids}: {missing} missing or outside the "
                f"vocabulary of {self.vocab_size}; config.json names them <name>_token_id"
            )

    @property
    def image_token_id(self) -> int:
        """The <|image_pad|> token each image embedding replaces (a vision model only)."""
        return self.vision_token_ids["image"]

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
        vision_fields: dict[str, Any] = {}
        if family.vision:
            cfg, vision_fields = _read_vision(cfg)
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
            **vision_fields,
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
        if self.vision is not None:
            # The hub's Qwen2.5-VL layout: text fields at the top, mrope in both rope layouts.
            assert self.mrope_section is not None  # checked with vision
            section = list(self.mrope_section)
            cfg["rope_scaling"] = {"type": "mrope", "rope_type": "default", "mrope_section": section}
            cfg["rope_parameters"] |= {"mrope_section": section}
            cfg["vision_config"] = self.vision.to_hf_config()
            cfg.update({f"{name}_token_id": token for name, token in self.vision_token_ids.items()})
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
        lm_head += 0 if self.vision is None else self.vision.num_params()
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


def _read_vision(cfg: dict) -> tuple[dict, dict[str, Any]]:
    """A vision model's config.json -> (the text model's keys at the top, without mrope; the vision fields of
    ModelArgs). Reads transformers 5's layout (text_config nested) and the hub's (text keys at the top,
    rope_scaling {"type": "mrope", "mrope_section": ...})."""
    text = {**cfg, **{k: v for k, v in (cfg.get("text_config") or {}).items() if k != "model_type"}}
    section = None
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(text.get(key) or {})
        section = rope.pop("mrope_section", section)
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text[key] = rope or None
    if "vision_config" not in cfg:
        raise ValueError(f"config.json model_type={cfg['model_type']!r} has no vision_config")
    fields = {
        "vision": VisionArgs.from_hf_config(cfg["vision_config"]),
        "mrope_section": None if section is None else tuple(section),
        "vision_token_ids": {
            n: cfg[f"{n}_token_id"] for n in VISION_TOKENS if cfg.get(f"{n}_token_id") is not None
        },
    }
    return text, fields


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
