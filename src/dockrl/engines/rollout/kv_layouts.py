"""The rollout engine's KV cache layouts: which one `kv_cache` resolves to, the blocks a sequence holds, the
cache's dtype. RolloutEngine (rollout_engine.py) keeps its cache in one of them.

Two cache layouts (`kv_cache`, rollout.kv_cache; "auto" picks slots when they fit kv_cache_tokens):
- slots: per layer k, v [num_slots, K, max_seq_len, D] (the model's `KVCache`), every slot's worst case
  allocated up front. Decode reads the slot range [0, hi) in place (one view, no gather, no copy).
- paged (models/paged_cache.py): per layer k, v [K, num_blocks, BLOCK_SIZE, D]; a slot's block-table row lists
  its blocks in position order. A sequence holds ceil(length / BLOCK_SIZE) blocks, not max_seq_len positions:
  the pool holds what the sequences use, grown by doubling up to `kv_cache_tokens` (samples wait or are
  preempted beyond it). Each decode step gathers the rows' first ceil(S / BLOCK_SIZE) blocks (a copy of the
  keys attended: why slots stay the default where they fit; docs/benchmarks.md).
Both in the weights' dtype on an accelerator and on a CPU with the native decode kernels, fp32 on a CPU without
them (`cache_dtype`).

Shape letters: K key-value heads, D head dimension, S key positions a decode step reads (rollout_engine.py).
"""

from __future__ import annotations

import torch

# Positions per KV block: a sequence wastes under one block (its last one's unwritten tail); larger blocks mean
# fewer, longer contiguous runs for the per-step gather (32 fp32 positions x D = 32: 4 KiB per key head).
BLOCK_SIZE = 32


def blocks_for(positions: int) -> int:
    """KV blocks that hold `positions` positions."""
    return -(-positions // BLOCK_SIZE)


def cache_dtype(weight_dtype: torch.dtype, device: torch.device, native_decode: bool = False) -> torch.dtype:
    """The KV cache's dtype: the weights' on an accelerator, and on a CPU whose decode steps run with the native
    kernels (models/native: they read a bf16 cache in place, half the bytes of fp32, and attend in fp32); fp32
    on a CPU otherwise, where a bf16 cache makes torch's decode attention slower, not faster (its key slices
    are strided, and the CPU's bf16 batched matmul copies each one first; fp32 reads them in place). The
    values are the same either way: the keys and values are the projections' (bf16) values, and a CPU's
    attention over them runs in fp32 (kv_cache.cached_attention)."""
    return torch.float32 if device.type == "cpu" and not native_decode else weight_dtype


def kv_layout(kv_cache: str, num_slots: int, max_seq_len: int, kv_cache_tokens: int) -> str:
    """The cache layout `kv_cache` resolves to: "auto" is "slots" when num_slots x max_seq_len positions fit
    kv_cache_tokens (0: no bound), "paged" when they do not; raises ValueError naming a layout that cannot be."""
    if kv_cache_tokens < 0:
        raise ValueError(f"rollout engine kv_cache_tokens={kv_cache_tokens} must be >= 0 (0: the worst case)")
    worst = num_slots * max_seq_len
    if kv_cache == "auto":
        return "slots" if not kv_cache_tokens or worst <= kv_cache_tokens else "paged"
    if kv_cache not in ("slots", "paged"):
        raise ValueError(f"rollout engine kv_cache={kv_cache!r}; use auto, slots or paged")
    if kv_cache == "slots" and 0 < kv_cache_tokens < worst:
        raise ValueError(
            f"rollout engine kv_cache=slots needs num_slots x max_seq_len = {num_slots} x {max_seq_len} = {worst} "
            f"positions, over kv_cache_tokens={kv_cache_tokens}; use kv_cache=paged or auto, or raise kv_cache_tokens"
        )
    return kv_cache
