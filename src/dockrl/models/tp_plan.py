"""Tensor-parallel plan of the Llama / Qwen2 / Qwen3 decoders: which parameter is split along which dim.

One plan serves the three families (they differ only in which biases and norms exist):

    embed_tokens.weight, lm_head.weight      vocab-parallel      split dim 0 (rows of the vocabulary)
    q/k/v_proj.weight and .bias (qwen2)       column-parallel     split dim 0 (whole heads per rank)
    gate_proj.weight, up_proj.weight          column-parallel     split dim 0
    o_proj.weight, down_proj.weight           row-parallel        split dim 1
    o_proj.bias, every RMSNorm weight         replicated          (q_norm/k_norm act per head on local heads)
    <column>.lora_B  [out, r]                 split dim 0         (with its base's rows; lora_A replicated)
    <row>.lora_A     [r, in]                  split dim 1         (with its base's columns; lora_B replicated)
    visual.*  (qwen2_5_vl's vision tower)     replicated          (every tp rank computes the image embeddings)

Rank r of a tp group holds the r-th of tp equal contiguous slices of each split parameter. Key/value heads
are split, never replicated: tp must divide num_kv_heads (and num_heads, vocab_size, intermediate_size).
Pure data and shape arithmetic; the modules that run it live in `dockrl.parallel.tensor_parallel`.
"""

from __future__ import annotations

import dataclasses

from dockrl.models.config import ModelArgs

_ROW_SPLIT = ("embed_tokens.weight", "lm_head.weight")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_ROW_PARALLEL_WEIGHTS = ("o_proj.weight", "down_proj.weight")


def shard_dim(name: str) -> int | None:
    """The dim along which parameter `name` is split under tensor parallelism; None = replicated."""
    if name.startswith("visual.") or ".visual." in name:  # its gate_proj etc. are the tower's own
        return None
    if name.endswith(_ROW_SPLIT):
        return 0
    module, _, leaf = name.rpartition(".")
    if leaf == "lora_B":
        return 0 if module.endswith(_COLUMN) else None
    if leaf == "lora_A":
        return 1 if module.endswith(_ROW_PARALLEL) else None
    if module.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW_PARALLEL_WEIGHTS):
        return 1
    return None


def shard_range(size: int, rank: int, num_shards: int) -> tuple[int, int]:
    """[start, end) of slice `rank` when `size` is split into `num_shards` equal parts."""
    assert size % num_shards == 0, f"{size} is not divisible by {num_shards}"
    step = size // num_shards
    return rank * step, (rank + 1) * step


def tp_problem(args: ModelArgs, tp: int) -> str | None:
    """Why `args` cannot be split `tp` ways, or None when it can."""
    if args.is_moe and tp > 1:
        return (
            f"model family={args.family!r} has experts, and tensor parallelism of MoE layers is not built yet "
            "(experts and router are replicated); use 1"
        )
    sizes = {
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.intermediate_size,
    }
    for name, value in sizes.items():
        if tp < 1 or value % tp:
            return f"does not divide model {name}={value}; use one of {valid_tp_sizes(args)}"
    return None


def valid_tp_sizes(args: ModelArgs) -> list[int]:
    """Every tensor-parallel degree this model can be split into."""
    if args.is_moe:
        return [1]
    sizes = (args.num_heads, args.num_kv_heads, args.vocab_size, args.intermediate_size)
    return [d for d in range(1, args.num_kv_heads + 1) if all(s % d == 0 for s in sizes)]


def local_args(args: ModelArgs, tp: int) -> ModelArgs:
    """Args describing one rank's shard: local query/key-value heads (KV caches are sized from these)."""
    if tp == 1:
        return args
    return dataclasses.replace(args, num_heads=args.num_heads // tp, num_kv_heads=args.num_kv_heads // tp)
