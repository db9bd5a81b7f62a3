"""`dockrl plan`: per-rank memory of the actor in each phase, predicted from a model config and layouts.

Phases of one RL step on one actor rank (bytes; P_t / P_i = this rank's training / inference share of the
parameters, exact per tensor from the TP plan; FSDP2 divides training shares by dp):

    train   = P_t x (4 param + 4 grad + 8 Adam) + gathered layer (x2, prefetch) + activations + logits slice
              (+ the KV cache when `reshard.free_kv_cache` is off)
    switch  = state kept on device + inference shard P_i x e + gather transient (chunks of at most a
              quarter bucket: ~2 chunks with one gather stage (dp or tp_train), ~3 with both, on gloo whose
              all-gathers stage through a flat copy; NCCL needs less, so this is an upper bound there)
    rollout = state kept on device + inference shard + KV cache (batch x seq x layers x 2 x K/tp_i x D x e)

State kept on device = what the `reshard.offload_*` flags leave there. Activation and logits terms are
estimates (no recomputation, fp32 logits chunk of one micro-batch); the switch term is exact bookkeeping
and is what `dockrl bench reshard` checks on CPU. Works for any size: only shapes are used, no tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dockrl.models.config import ModelArgs
from dockrl.models.tp_plan import shard_dim, tp_problem

PRESETS: dict[str, dict] = {
    "Qwen2.5-7B": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
    "Qwen2.5-32B": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
    ),
    "Qwen3-8B": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
GIB = 2**30


@dataclass
class PlanInput:
    """A layout question: model, (dp, tp_train) -> tp_infer, offload flags, batch shapes, dtypes."""

    args: ModelArgs
    dp: int
    tp_train: int
    tp_infer: int
    offload_optimizer: bool = True
    offload_grads: bool = True
    offload_params: bool = True
    micro_batch_size: int = 1
    train_seq_len: int = 4096
    rollout_batch: int = 64
    rollout_seq_len: int = 4096
    infer_bytes: int = 2  # bf16 rollout weights and KV cache
    free_kv_cache: bool = True  # reshard.free_kv_cache: the KV cache is not held while training
    bucket_bytes: int | None = None  # reshard.bucket_mb; None: the largest tensor (fp32), rounded up to MiB


def load_args(model: str) -> ModelArgs:
    """ModelArgs from a preset name, a config.json file or a model directory."""
    if model in PRESETS:
        cfg = dict(PRESETS[model])
    else:
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(
                f"--model={model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json"
            )
        cfg = json.loads(path.read_text())
    return ModelArgs.from_hf_config(cfg)


def shares(args: ModelArgs, dp: int, tp_train: int, tp_infer: int) -> dict[str, int]:
    """Element counts: this rank's training share, inference share, largest tensor and its training slice."""
    import torch

    from dockrl.models.decoder import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    train = infer = largest = layer = 0
    for name, param in model.named_parameters():
        n, split = param.numel(), shard_dim(name) is not None
        train += -(-(n // tp_train if split else n) // dp)
        infer += n // tp_infer if split else n
        largest = max(largest, n)
        if ".layers.0." in name:
            layer += n // tp_train if split else n
    return {
        "train": train,
        "infer": infer,
        "largest": largest,
        "layer": layer,
    }


def plan(p: PlanInput) -> dict[str, float]:
    """Per-rank bytes of each phase (see module docstring)."""
    for key, tp in (("tp_train", p.tp_train), ("tp_infer", p.tp_infer)):
        problem = tp_problem(p.args, tp)
        if problem is not None:
            raise ValueError(f"{key}={tp} {problem}")
    if (p.dp * p.tp_train) % p.tp_infer:
        raise ValueError(f"tp_infer={p.tp_infer} does not divide dp x tp_train = {p.dp * p.tp_train} ranks")
    a, s = p.args, shares(p.args, p.dp, p.tp_train, p.tp_infer)
    params, grads, optim = 4 * s["train"], 4 * s["train"], 8 * s["train"]
    tokens = p.micro_batch_size * p.train_seq_len
    activations = tokens * a.num_layers * a.hidden_size * 2 * 16 // p.tp_train  # ~16 bf16 [T, H]-sized saves
    logits = tokens * (a.vocab_size // p.tp_train) * 4 * 3  # fp32 logits, softmax and grad of one micro-batch
    train = params + grads + optim + 2 * 2 * s["layer"] + activations + logits
    kept = (0 if p.offload_params else params) + (0 if p.offload_optimizer else optim)
    kept += 0 if p.offload_grads else grads
    inference = s["infer"] * p.infer_bytes
    bucket = p.bucket_bytes or -(-4 * s["largest"] // 2**20) * 2**20
    stages = (p.dp > 1) + (p.tp_train > 1)
    transient = (0, 2, 3)[stages] * bucket // 4
    switch = params + (0 if p.offload_optimizer else optim) + (0 if p.offload_grads else grads)
    switch += inference + transient
    kv = p.rollout_batch * p.rollout_seq_len * a.num_layers * 2 * (a.num_kv_heads // p.tp_infer) * a.head_dim
    kv *= p.infer_bytes
    rollout = kept + inference + kv
    if not p.free_kv_cache:
        train += kv
    return {
        "num_params": float(a.num_params()),
        "train_bytes": float(train),
        "switch_bytes": float(switch),
        "switch_extra_bytes": float(inference + transient),
        "rollout_bytes": float(rollout),
        "inference_shard_bytes": float(inference),
        "kv_cache_bytes": float(kv),
        "train_state_bytes": float(params + grads + optim),
    }


def render(result: dict[str, float], device_gib: float | None) -> str:
    """Human-readable table, with a fits / does not fit verdict per phase."""
    lines = [f"parameters: {result['num_params'] / 1e9:.2f} B"]
    for phase in ("train", "switch", "rollout"):
        gib = result[f"{phase}_bytes"] / GIB
        verdict = "" if device_gib is None else ("  fits" if gib <= device_gib else "  DOES NOT FIT")
        lines.append(f"{phase:>8}: {gib:8.2f} GiB per rank{verdict}")
    lines.append(
        f"  (inference shard {result['inference_shard_bytes'] / GIB:.2f} GiB, "
        f"KV cache {result['kv_cache_bytes'] / GIB:.2f} GiB, "
        f"training state {result['train_state_bytes'] / GIB:.2f} GiB)"
    )
    return "\n".join(lines)
