"""LoRA on dockrl's decoder: low-rank adapters on chosen linear layers, PEFT's file format in and out.

A LoRA layer keeps the frozen base weight W [out, in] and adds two trainable factors:

    y = x W^T + b + s * dropout(x) A^T B^T        A [r, in], B [out, r], s = alpha / r

B starts at zero, so an adapted model computes exactly what its base does until the first update. The layer
is an `nn.Linear` subclass: the base parameters keep their Hugging Face names (`q_proj.weight`), so the
tensor-parallel plan, FSDP2 and checkpoints see the same tree, and the adapters sit beside them
(`q_proj.lora_A`, `q_proj.lora_B`). Switching adapters off (`adapters_disabled`) turns the policy back into the
base model: that is the reference policy of a LoRA run, with no second copy of the weights.

Under tensor parallelism (dockrl.parallel.tensor_parallel) the factors split with their base layer:
column-parallel base (q/k/v, gate/up; W split by rows): B split by rows, A replicated; row-parallel base
(o, down; W split by columns): A split by columns, B replicated. The replicated factor's gradient is partial
on each rank; `sync_replicated` (set by the tp code) sums it over the tp group.

PEFT's adapter directory (`adapter_config.json` + `adapter_model.safetensors`) names the factors
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]; `save_peft` and
`load_peft` read and write that layout.

Shape letters: N tokens (any leading dims), I in-features, O out-features, r the rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dockrl.models.config import ModelArgs
from dockrl.models.decoder import Transformer

# Re-exported: the decoder's linear layers that take adapters (never the LM head).
from dockrl.models.families import LINEAR_NAMES as LINEAR_NAMES
from dockrl.models.families import linear_targets

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how: rank r, alpha (the scale is alpha / r), dropout on the adapter's input, and the
    short module names adapted (a subset of LINEAR_NAMES)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """s = alpha / r."""
        return self.alpha / self.rank


def resolve_targets(target_modules: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`all-linear` or a list of short layer names -> the names adapted (models.families.linear_targets)."""
    return linear_targets(target_modules, "actor.lora.target_modules")


def fresh_factors(
    rank: int, in_features: int, out_features: int, seed: int | None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, I] ~ kaiming-uniform(a=sqrt(5)) on fan_in = I, as PEFT draws it; B [O, r] = 0. fp32."""
    if torch.device(device).type == "meta":
        return torch.empty(rank, in_features, device="meta"), torch.empty(out_features, rank, device="meta")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    a = torch.empty(rank, in_features, dtype=torch.float32)
    bound = 1.0 / in_features**0.5
    a.uniform_(-bound, bound, generator=generator)
    return a.to(device), torch.zeros(out_features, rank, device=device)


class LoRALinear(nn.Linear):
    """nn.Linear with a low-rank adapter (see the module docstring). Build it with `LoRALinear.wrap`."""

    lora_A: nn.Parameter  # [r, I] (I/tp under a row-parallel base)
    lora_B: nn.Parameter  # [O, r] (O/tp under a column-parallel base)

    def init_adapter(self, rank: int, scaling: float, dropout: float, seed: int | None = None) -> None:
        """Fresh factors (`fresh_factors`; on the meta device only their shapes), fp32 and trainable."""
        a, b = fresh_factors(rank, self.in_features, self.out_features, seed, self.weight.device)
        self.lora_A, self.lora_B = nn.Parameter(a), nn.Parameter(b)
        self.lora_scaling = scaling
        self.lora_dropout = dropout
        self.lora_enabled = True
        # Set by tensor parallelism: sums the replicated factor's partial gradient over the tp group.
        self.sync_replicated: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.replicated_factor = "lora_A"

    @classmethod
    def wrap(cls, linear: nn.Linear, spec: LoraSpec, seed: int | None = None) -> LoRALinear:
        """Turn `linear` into a LoRALinear in place (its weight and bias are kept, frozen)."""
        linear.__class__ = cls
        assert isinstance(linear, LoRALinear)
        linear.weight.requires_grad_(False)
        if linear.bias is not None:
            linear.bias.requires_grad_(False)
        linear.init_adapter(spec.rank, spec.scaling, spec.dropout, seed)
        return linear

    def adapter_delta(self) -> torch.Tensor:
        """s * B A [O, I] in fp32: what merging adds to the base weight."""
        return self.lora_scaling * (self.lora_B.float() @ self.lora_A.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, I] -> [N, O]."""
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        a: torch.Tensor = self.lora_A
        b: torch.Tensor = self.lora_B
        if self.sync_replicated is not None:
            if self.replicated_factor == "lora_A":
                a = self.sync_replicated(a)
            else:
                b = self.sync_replicated(b)
        if self.training and self.lora_dropout > 0:
            x = F.dropout(x, self.lora_dropout)
        low = F.linear(x.to(a.dtype), a)  # [N, r]
        return out + (self.lora_scaling * F.linear(low, b)).to(out.dtype)


def apply_lora(model: nn.Module, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Wrap every target linear layer of `model` (a Transformer) in place, freeze every other parameter;
    returns the adapted module names. The i-th adapted module draws its A with seed `adapter_seed(seed, i)`
    (`fresh_adapters` draws the same values for a model built on the meta device)."""
    adapted = [name for name, module in model.named_modules() if _is_target(name, module, spec)]
    for param in model.parameters():
        param.requires_grad_(False)
    for index, name in enumerate(adapted):
        LoRALinear.wrap(model.get_submodule(name), spec, seed=adapter_seed(seed, index))  # type: ignore[arg-type]
    return adapted


def adapter_seed(seed: int, index: int) -> int:
    """The seed of the index-th adapted module's A."""
    return seed * 1_000_003 + index


def fresh_adapters(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """The initial adapters of `model` (LoRA applied, e.g. on the meta device) as whole CPU tensors, keyed by
    parameter name: what `apply_lora(model, spec, seed)` draws on a real device. A sharded engine loads each
    rank's block of these (dockrl.parallel.sharded_load's fallback), so every layout starts equal."""
    out = {}
    for index, (name, layer) in enumerate(lora_layers(model)):
        rank, in_features = layer.lora_A.shape
        a, b = fresh_factors(rank, in_features, layer.lora_B.shape[0], adapter_seed(seed, index))
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a, b
    return out


def adapter_layout(args: ModelArgs, spec: LoraSpec) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, whole shape, shape) of every adapter factor of a `Transformer(args)` under `spec`, in module
    order (A before B): the order adapter-only weight sync packs them in, on the trainer and on a replica."""
    with torch.device("meta"):
        model = Transformer(args)
        apply_lora(model, spec)
    out = []
    for name, layer in lora_layers(model):
        for factor in ("lora_A", "lora_B"):
            shape = tuple(getattr(layer, factor).shape)
            out.append((f"{name}.{factor}", shape, shape))
    return out


def _is_target(name: str, module: nn.Module, spec: LoraSpec) -> bool:
    # A vision model's tower (`visual.`, models/vision.py) has linears of the same short names (gate_proj, ...):
    # adapters go on the language model only, the tower stays frozen with every other base weight.
    in_language_model = "visual" not in name.split(".")
    return (
        isinstance(module, nn.Linear) and in_language_model and name.rpartition(".")[2] in spec.target_modules
    )


class AdaptedLayer(Protocol):
    """What every layer with an adapter has: LoRALinear, or the tensor-parallel module that took over a LoRA
    base."""

    lora_A: nn.Parameter  # [r, I]
    lora_B: nn.Parameter  # [O, r]
    lora_enabled: bool


def lora_layers(model: nn.Module) -> Iterator[tuple[str, AdaptedLayer]]:
    """(module name, layer) of every layer of `model` with an adapter: LoRALinear, or the tensor-parallel
    module that took over a LoRA base (it keeps `lora_A`, `lora_B`, `lora_enabled`)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "lora_A", None), nn.Parameter):
            yield name, cast(AdaptedLayer, module)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only: {`<module>.lora_A`: [r, I], `<module>.lora_B`: [O, r]} (what checkpoints and
    adapter-only weight sync carry)."""
    out = {}
    for name, layer in lora_layers(model):
        out[f"{name}.lora_A"] = layer.lora_A.detach()
        out[f"{name}.lora_B"] = layer.lora_B.detach()
    return out


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base model inside the block (the reference policy of a LoRA run)."""
    layers = [layer for _, layer in lora_layers(model)]
    states = [layer.lora_enabled for layer in layers]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer, state in zip(layers, states):
            layer.lora_enabled = state


@torch.no_grad()
def merge_into(
    name: str,
    weight: torch.Tensor,
    adapters: dict[str, torch.Tensor],
    scaling: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`weight` of parameter `name` with its adapter merged: W + s * B A, accumulated in fp32 and cast once to
    `dtype` (default W's: a bf16 base exported as fp32 keeps the whole update, not its bf16 rounding);
    `weight` itself when `name` has no adapter in `adapters` (keys as `adapter_state` writes them)."""
    module = name.removesuffix(".weight")
    a, b = adapters.get(f"{module}.lora_A"), adapters.get(f"{module}.lora_B")
    if a is None or b is None or not name.endswith(".weight"):
        return weight
    return (weight.float() + scaling * (b.float() @ a.float())).to(dtype or weight.dtype)


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight and turn the layers back into plain nn.Linear."""
    for _, layer in list(lora_layers(model)):
        assert isinstance(layer, LoRALinear), "merge a model that is not tensor-parallel"
        layer.weight.copy_((layer.weight.float() + layer.adapter_delta()).to(layer.weight.dtype))
        for attr in ("lora_A", "lora_B"):
            delattr(layer, attr)
        base: nn.Module = layer  # typed as the base class, whose class it takes back
        base.__class__ = nn.Linear


def save_peft(model: nn.Module, out: str | Path, spec: LoraSpec, base_model_path: str) -> Path:
    """Write `model`'s adapters as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
    that `peft.PeftModel.from_pretrained` loads onto the transformers base model."""
    return save_peft_tensors(adapter_state(model), out, spec, base_model_path)


PER_MODULE_KEYS = (
    "alpha_pattern",
    "rank_pattern",
    "layers_to_transform",
    "layers_pattern",
    "exclude_modules",
)


def read_peft_spec(path: str | Path) -> LoraSpec:
    """The LoraSpec of a PEFT adapter directory; raises ValueError naming what dockrl does not support."""
    path = Path(path)
    config_file = path / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(
            f"model.lora_path={path}: no {ADAPTER_CONFIG_FILE} (a PEFT adapter directory)"
        )
    config = json.loads(config_file.read_text(encoding="utf-8"))
    unsupported = {
        key: config.get(key)
        for key, ok in (("peft_type", "LORA"), ("bias", "none"), ("use_dora", False), ("use_rslora", False))
        if config.get(key, ok) != ok
    }
    if config.get("fan_in_fan_out", False) or unsupported:
        raise ValueError(
            f"model.lora_path={path}: dockrl reads plain LoRA adapters; unsupported {unsupported}"
        )
    # Per-module scales and ranks, and layer selections, change which weights move and by how much: never
    # ignored (PEFT's q_proj at alpha_pattern 8.0 is not the file's lora_alpha 2.0), refused until read.
    patterned = {key: config[key] for key in PER_MODULE_KEYS if config.get(key)}
    if patterned:
        raise ValueError(
            f"model.lora_path={path}: adapter_config.json sets {patterned}, which dockrl does not read (one rank "
            "and alpha for every adapted module of every layer); re-save the adapter without them"
        )
    return LoraSpec(
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout", 0.0)),
        target_modules=resolve_targets(config["target_modules"]),
    )


def read_peft_adapters(path: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT directory keyed as dockrl names them (`<module>.lora_A`, `.lora_B`), fp32:
    the `lora_init` of a sharded engine (each rank takes its block)."""
    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS_FILE))
    out = {}
    for key, value in tensors.items():
        if not (key.startswith(PEFT_PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise ValueError(
                f"model.lora_path={path}: unexpected tensor {key} (dockrl reads plain LoRA adapters)"
            )
        out[key.removeprefix(PEFT_PREFIX).removesuffix(".weight")] = value.float()
    return out


@torch.no_grad()
def load_peft(model: nn.Module, path: str | Path) -> LoraSpec:
    """Apply the PEFT adapter directory `path` to `model` (a base Transformer: adapters are added) and return
    its spec; raises ValueError naming a missing or unexpected tensor, or a shape that differs."""
    spec = read_peft_spec(path)
    adapted = apply_lora(model, spec)
    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS_FILE))
    expected = {f"{PEFT_PREFIX}{name}.lora_{f}.weight" for name in adapted for f in ("A", "B")}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(
            f"model.lora_path={path}: adapter tensors missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name in adapted:
        layer = model.get_submodule(name)
        for factor in ("A", "B"):
            value = tensors[f"{PEFT_PREFIX}{name}.lora_{factor}.weight"]
            param = getattr(layer, f"lora_{factor}")
            if value.shape != param.shape:
                raise ValueError(
                    f"model.lora_path={path}: {name}.lora_{factor} has shape {tuple(value.shape)}, the model "
                    f"needs {tuple(param.shape)}"
                )
            param.copy_(value)
    return spec


def save_peft_tensors(
    adapters: dict[str, torch.Tensor],
    out: str | Path,
    spec: LoraSpec,
    base_model_path: str,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write whole adapters (`<module>.lora_A` [r, I], `<module>.lora_B` [O, r], as `adapter_state` keys them)
    as a PEFT adapter directory, tensors in `dtype`; returns it. What a LoRA checkpoint's adapter/ holds."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{PEFT_PREFIX}{name}.weight": t.detach().to("cpu", dtype).contiguous()
        for name, t in adapters.items()
    }
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(_peft_config(spec, base_model_path), indent=2) + "\n")
    return out


def _peft_config(spec: LoraSpec, base_model_path: str) -> dict:
    """adapter_config.json of a plain LoRA adapter, as PEFT reads it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
