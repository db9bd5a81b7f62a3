"""`dockrl plan`: per-rank memory of the actor in each phase, predicted from a model config and layouts.

Phases of one RL step on one actor rank (bytes; P_t / P_i = this rank's training / inference share of the
parameters, exact per tensor from the TP plan; FSDP2 divides training shares by dp x cp):

    train   = P_t x (4 param + 4 grad + 8 Adam) + the update's peak (`update_peak`: saved activations of this
              rank's tokens, FSDP2's gathered layers and root, the backward's largest transient)
              (+ the KV cache when `reshard.free_kv_cache` is off)
    switch  = state kept on device + inference shard P_i x e + gather transient (chunks of at most a
              quarter bucket: ~2 chunks with one gather stage (dp or tp_train), ~3 with both, on gloo whose
              all-gathers stage through a flat copy; NCCL needs less, so this is an upper bound there)
    rollout = state kept on device + inference shard + KV cache (batch x seq x layers x 2 x K/tp_i x D x e)

State kept on device = what the `reshard.offload_*` flags leave there. The update's peak is an estimate from the
decoder's saved tensors (`update_peak`; `dockrl bench longctx` measures it on CPU, docs/benchmarks.md); the switch
term is exact bookkeeping and is what `dockrl bench reshard` checks on CPU. Works for any size: only shapes are
used, no tensors.

Context parallelism (cp, actor.cp): a rank holds padded(T) / cp tokens of each row (2 cp zig-zag chunks), so the
saved activations scale ~1/cp; the training state is sharded over dp x cp. `smallest_cp` names the least cp at
which the train phase fits a device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dockrl.config.schema import FSDP_UNIT_PARAMS
from dockrl.models.config import ModelArgs
from dockrl.models.tp_plan import shard_dim, tp_problem
from dockrl.parallel.fsdp_units import fsdp_units

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
    cp: int = 1
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
    activation_bytes: int = 2  # bf16 training compute (4: run.precision=fp32)
    activation_checkpointing: bool = False  # actor.activation_checkpointing
    fsdp_unit_params: int = FSDP_UNIT_PARAMS  # actor.fsdp_unit_params


def load_args(model: str) -> ModelArgs:
    """ModelArgs from a preset name (any case), a config.json file or a model directory."""
    preset = {name.lower(): name for name in PRESETS}.get(model.lower())
    if preset is not None:
        cfg = dict(PRESETS[preset])
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
    train = infer = largest = layer = 0
    for name, n in _param_sizes(args):
        split = shard_dim(name) is not None
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


_PARAM_SIZES: dict[str, tuple[tuple[str, int], ...]] = {}


def _param_sizes(args: ModelArgs) -> tuple[tuple[str, int], ...]:
    """(name, elements) of every parameter of the model `args` builds (on the meta device; cached by the args'
    repr, as `smallest_cp` asks for the same model at many cp)."""
    key = repr(args)
    if key not in _PARAM_SIZES:
        import torch

        from dockrl.models.decoder import Transformer

        with torch.device("meta"):
            model = Transformer(args)
        _PARAM_SIZES[key] = tuple((name, param.numel()) for name, param in model.named_parameters())
    return _PARAM_SIZES[key]


def plan(p: PlanInput) -> dict[str, float]:
    """Per-rank bytes of each phase (see module docstring)."""
    for key, tp in (("tp_train", p.tp_train), ("tp_infer", p.tp_infer)):
        problem = tp_problem(p.args, tp)
        if problem is not None:
            raise ValueError(f"{key}={tp} {problem}")
    if p.cp < 1:
        raise ValueError(f"cp={p.cp} must be >= 1")
    ranks = p.dp * p.cp * p.tp_train
    if ranks % p.tp_infer:
        raise ValueError(f"tp_infer={p.tp_infer} does not divide dp x cp x tp_train = {ranks} ranks")
    a, s = p.args, shares(p.args, p.dp * p.cp, p.tp_train, p.tp_infer)
    params, grads, optim = 4 * s["train"], 4 * s["train"], 8 * s["train"]
    peak = update_peak(
        a,
        rows=p.micro_batch_size,
        seq_len=p.train_seq_len,
        cp=p.cp,
        tp=p.tp_train,
        dtype_bytes=p.activation_bytes,
        checkpointing=p.activation_checkpointing,
        unit_params=p.fsdp_unit_params,
    )
    train = params + grads + optim + peak["total"]
    kept = (0 if p.offload_params else params) + (0 if p.offload_optimizer else optim)
    kept += 0 if p.offload_grads else grads
    inference = s["infer"] * p.infer_bytes
    bucket = p.bucket_bytes or -(-4 * s["largest"] // 2**20) * 2**20
    stages = (p.dp * p.cp > 1) + (p.tp_train > 1)
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
        "activation_bytes": peak["saved"],
        "update_peak_bytes": peak["total"],
    }


# Ring attention's tiles (dockrl.parallel.context._TILE_ELEMENTS) and the fused head's chunks
# (dockrl.algos.head_logprobs._CHUNK_ELEMENTS, _MIN_CHUNK_TOKENS): fp32 buffers of this many elements.
RING_TILE_ELEMENTS = 1 << 22
HEAD_CHUNK_ELEMENTS = 1 << 21
HEAD_MIN_CHUNK_TOKENS = 128


def update_peak(
    args: ModelArgs,
    *,
    rows: int,
    seq_len: int,
    cp: int = 1,
    tp: int = 1,
    dtype_bytes: int = 2,
    checkpointing: bool = False,
    unit_params: int = FSDP_UNIT_PARAMS,
) -> dict[str, float]:
    """Bytes one training rank adds to its standing state (parameters, gradients, AdamW) during one micro-batch's
    forward and backward: `rows` rows of `seq_len` tokens, split over `cp` ranks (each holds padded / cp tokens,
    t below), the heads, kv heads and MLP width over `tp`; e = `dtype_bytes` (the compute dtype).

    saved     what autograd keeps for the backward, per layer and token: two RMSNorms (the input and the
              weighted output: 2eH each; models/rms_norm.py), q, k, v after rotary and the attention output,
              which is o_proj's input (e (2 N + 2 K) D; the ring keeps its fp32 output beside it, 4 N D), the
              fp32 log-sum-exp (4 N), the MLP's gate, silu, up and product (4 e I); outside the layers the final
              norm, the head's scored hidden states and the rotary tables. With activation checkpointing: each
              layer's input e H, and one layer's whole set while it is recomputed. (Checked against the
              tensors autograd saves: tests/unit/test_plan.py.)
    fsdp      FSDP2's all-gathered copies: two units (the prefetch; a unit is one layer, or consecutive layers
              of at least `unit_params` parameters: parallel.fsdp_units) in the compute dtype, one unit's
              unsharded fp32 gradient, and the root (embedding, head, final norm and the layers no unit took:
              unsharded for the whole step, with their fp32 gradients).
    transient the backward's largest buffer set at its start: the fused head's three fp32 chunks, or one
              layer's attention backward (cp = 1: the q, k, v gradients; cp > 1: the ring's fp32 q and
              travelling key/value gradients, the key/value block and its received copy, and two score tiles),
              plus the residual stream's gradient (2 e H per token)."""
    from dockrl.parallel.context import padded_length

    e, d, h = dtype_bytes, args.head_dim, args.hidden_size
    heads, kv_heads, width = args.num_heads // tp, args.num_kv_heads // tp, args.intermediate_size // tp
    local = rows * padded_length(seq_len, cp) // cp  # t: this rank's tokens
    # the fused kernel's output is o_proj's input; the ring keeps its fp32 output beside it
    ring_out = 4 if cp > 1 else 0
    norm = 2 * e * h  # its input (its backward's) and its output (the projections')
    per_layer = (
        2 * norm + e * (2 * heads + 2 * kv_heads) * d + ring_out * heads * d + 4 * heads + 4 * e * width
    )
    if checkpointing:
        layers = local * (args.num_layers * e * h + per_layer)
    else:
        layers = local * args.num_layers * per_layer
    # the final norm (its input; the head reads its output by index), the head's
    # gathered hidden states of the scored tokens (at most t) with their int64 index and target ids and two fp32
    # statistics (24 bytes), the rotary cos and sin tables
    saved = layers + local * (e * h + e * h + 24 + 2 * e * d)
    layer_params, root_params = _layer_and_root_params(args, tp)
    units = fsdp_units([layer_params] * args.num_layers, unit_params)
    unit = len(units[0]) * layer_params if units else 0
    rest = (args.num_layers - sum(len(u) for u in units)) * layer_params
    fsdp = min(2, len(units)) * e * unit + 4 * unit + (e + 4) * (root_params + rest)
    vocab = args.vocab_size // tp
    chunk = min(local, max(HEAD_MIN_CHUNK_TOKENS, HEAD_CHUNK_ELEMENTS // vocab))
    head = 3 * 4 * chunk * vocab
    if cp == 1:
        attention = e * local * (heads + 2 * kv_heads) * d
    else:
        chunk_tokens = padded_length(seq_len, cp) // (2 * cp)  # c: one zig-zag chunk
        tile_rows = min(chunk_tokens, max(1, RING_TILE_ELEMENTS // max(1, rows * heads * chunk_tokens)))
        tiles = 2 * 4 * rows * heads * tile_rows * chunk_tokens
        kv_block = 2 * local * kv_heads * d
        attention = 4 * local * heads * (d + 1) + 2 * 4 * kv_block + 2 * e * kv_block + tiles
    transient = max(head, attention) + 2 * e * h * local
    return {
        "saved": float(saved),
        "fsdp": float(fsdp),
        "transient": float(transient),
        "total": float(saved + fsdp + transient),
    }


def _layer_and_root_params(args: ModelArgs, tp: int) -> tuple[int, int]:
    """Elements of one decoder layer and of the root (embedding, LM head unless tied, final norm) on a tp rank."""
    h, d = args.hidden_size, args.head_dim
    attention = h * d * (2 * args.num_heads + 2 * args.num_kv_heads) // tp
    mlp = 3 * h * args.intermediate_size // tp
    layer = attention + mlp + 2 * h
    embedding = args.vocab_size * h // tp
    root = embedding * (1 if args.tie_word_embeddings else 2) + h
    return layer, root


def smallest_cp(question: PlanInput, device_bytes: float, most: int = 64) -> int | None:
    """The least cp (1 ... `most`) at which the train phase of `question` fits `device_bytes` per rank; None if
    none does (then raise dp, tp_train, or turn on activation checkpointing)."""
    from dataclasses import replace

    for cp in range(1, most + 1):
        if plan(replace(question, cp=cp))["train_bytes"] <= device_bytes:
            return cp
    return None


def parse_bytes(text: str) -> float:
    """Bytes of a size with its unit: 80GB (10^9), 80GiB (2^30), also MB / MiB, TB / TiB; a bare number is GiB."""
    units = {"": GIB, "gib": GIB, "gb": 1e9, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12}
    import re

    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if found is None or found.group(2) not in units:
        raise ValueError(f"device memory {text!r}: use a number and a unit, e.g. 80GB or 80GiB")
    return float(found.group(1)) * units[found.group(2)]


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
        f"training state {result['train_state_bytes'] / GIB:.2f} GiB, "
        f"update peak {result['update_peak_bytes'] / GIB:.2f} GiB of which saved activations "
        f"{result['activation_bytes'] / GIB:.2f} GiB)"
    )
    if "smallest_cp" in result:
        cp = int(result["smallest_cp"])
        lines.append(
            f"smallest cp at which train fits {device_gib:.1f} GiB: {cp}"
            if cp
            else f"train does not fit {device_gib:.1f} GiB at any cp up to 64 (raise dp or tp, or checkpoint)"
        )
    return "\n".join(lines)
