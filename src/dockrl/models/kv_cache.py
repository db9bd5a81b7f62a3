"""The decoder's key/value cache and the attention over it: `KVCache` (slots preallocated per sequence),
`CacheWrite` (where a forward puts its new keys and values: every row at one offset, each row at its own, or a
`PagedKVCache`'s blocks; models/paged_cache.py), `cached_attention` (one layer's write and read) and the masks
of each path (`attention_mask`, boolean; `row_offset_bias`, additive). Shape letters as in models/decoder.py:
B batch, T new tokens, S key slots attended, N query heads, K key/value heads, D head dim."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dockrl.models.attention import sdpa
from dockrl.models.config import ModelArgs
from dockrl.models.paged_cache import PagedKVCache, paged_attention, write_blocks


class KVCache:
    """Static preallocated key/value cache; per layer k and v of shape [B, K, max_len, D].

    Lifecycle: allocated once per generation batch; each forward with `kv_cache=` writes the new keys (after
    RoPE) and values at slots [cache_offset, cache_offset + T) and reads slots [0, cache_offset + T).
    Slots past the last write hold stale data and are never read.
    """

    def __init__(
        self,
        args: ModelArgs,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch_size, args.num_kv_heads, max_len, args.head_dim)
        self.batch_size = batch_size
        self.max_len = max_len
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)
        ]

    def rows(self, num_rows: int, start: int = 0) -> KVCache:
        """A view of sequences [start, start + num_rows) of this cache (shares storage, allocates nothing)."""
        view = KVCache.__new__(KVCache)
        view.batch_size, view.max_len = num_rows, self.max_len
        view.k = [k[start : start + num_rows] for k in self.k]
        view.v = [v[start : start + num_rows] for v in self.v]
        return view

    def take(self, rows: torch.Tensor, num_positions: int) -> KVCache:
        """A copy of positions [0, num_positions) of the sequences `rows` (int64 [R], any order): a cache of R
        sequences (`put` writes it back)."""
        copy = KVCache.__new__(KVCache)
        copy.batch_size, copy.max_len = len(rows), num_positions
        # index_select: half the time of advanced indexing over the same slice on CPU
        copy.k = [k[:, :, :num_positions].index_select(0, rows) for k in self.k]
        copy.v = [v[:, :, :num_positions].index_select(0, rows) for v in self.v]
        return copy

    def put(self, rows: torch.Tensor, part: KVCache) -> None:
        """Write `part` (from `take`) back into the sequences `rows`, positions [0, part.max_len)."""
        for k, v, part_k, part_v in zip(self.k, self.v, part.k, part.v):
            k[rows, :, : part.max_len] = part_k
            v[rows, :, : part.max_len] = part_v

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What one attention layer gets: its (keys, values)."""
        return self.k[index], self.v[index]


@dataclass(frozen=True)
class CacheWrite:
    """Where one forward pass puts its new keys/values (see the module docstring): slots [offset, offset + T)
    of every row of a KVCache, or, with `row_offsets` [B] (int64), each row from its own offset: into its own
    row of a KVCache, or, with `block_table` [B, M] (int64), into the blocks of a PagedKVCache."""

    cache: KVCache | PagedKVCache
    offset: int = 0
    row_offsets: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    # A pass with row_offsets (a decode step, or a returning turn's new tokens) may run its layers with the
    # native kernels (models/native) where they apply: the rollout engine's rollout.native_kernels.
    native: bool = False
    # With the native kernels, row b's sequence in a KVCache may be another row than b: `rows` [B] (int64)
    # names it (the rollout engine's returning turns read and write their slots in place).
    rows: torch.Tensor | None = None


def _write_rows(
    cache: tuple[torch.Tensor, torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    cache_offset: torch.Tensor,
    num_keys: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v [B, K, T, D] of cache rows 0..B-1 at per-row slots cache_offset[b] + t; return the key and value
    slots [B, K, S, D] (views)."""
    cache_k, cache_v = cache
    batch, seq = k.shape[0], k.shape[2]
    rows = torch.arange(batch, device=k.device)
    if seq == 1:  # decode: advanced indices on dims 0 and 2 around a slice index a [B, K, D] view
        cache_k[rows, :, cache_offset] = k[:, :, 0]
        cache_v[rows, :, cache_offset] = v[:, :, 0]
    else:  # the indexed view is [B, T, K, D]
        slots = cache_offset[:, None] + torch.arange(seq, device=k.device)  # [B, T]
        cache_k[rows[:, None], :, slots] = k.transpose(1, 2)
        cache_v[rows[:, None], :, slots] = v.transpose(1, 2)
    return cache_k[:, :, :num_keys], cache_v[:, :, :num_keys]


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cache: tuple | None,
    write: CacheWrite,
) -> torch.Tensor:
    """Write k, v [B, K, T, D] into this layer's cache and attend q [B, N, T, D] over its key slots, in
    `attention_dtype` (fp32 on a CPU, whatever the cache's dtype: a bf16 cache holds the bf16 projections' values
    exactly, and is read into fp32 here; kv_layouts.cache_dtype in engines/rollout). `mask`: with per-row
    offsets the additive bias [B, 1, T, S] of `row_offset_bias`, else boolean [B, 1, T, S]."""
    assert cache is not None, "a cache write needs the layer's cache"
    dtype = cache[0].dtype
    compute = attention_dtype(dtype, q.device)
    q, k, v = q.to(compute), k.to(dtype), v.to(dtype)
    if write.row_offsets is not None and write.block_table is None:  # continuous batching, max-length slots
        assert mask is not None, "per-row offsets always come with a mask"
        k, v = _write_rows(cache, k, v, write.row_offsets, mask.shape[-1])
        # the slots read in place (a copy only where the cache is not in `compute`)
        return grouped_attention(q, k.to(compute), v.to(compute), mask)  # [B, N, T, D]
    if write.row_offsets is not None:  # continuous batching over a paged cache
        table = write.block_table
        assert mask is not None and table is not None, "per-row offsets always come with a mask"
        assert isinstance(write.cache, PagedKVCache), "a block table addresses a paged cache"
        write_blocks(cache, k, v, write.row_offsets, table)
        keys, values = write.cache.gather(cache, table, mask.shape[-1])
        return paged_attention(q, keys.to(compute), values.to(compute), mask, q.shape[0])  # [B, N, T, D]
    cache_k, cache_v = cache  # every row at the same offset
    end = write.offset + q.shape[2]
    cache_k[:, :, write.offset : end] = k
    cache_v[:, :, write.offset : end] = v
    k, v = cache_k[:, :, :end], cache_v[:, :, :end]  # [B, K, S, D]
    return sdpa(q, k.to(compute), v.to(compute), mask)


def attention_dtype(cache_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a cached attention computes in: fp32 on a CPU (its bf16 batched matmuls would round the scores
    to bf16 and copy strided keys first), the cache's own on an accelerator."""
    return torch.float32 if device.type == "cpu" else cache_dtype


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax attention q [B, N, T, D] over k, v [B, K, S, D] (not repeated per query head) under the additive
    `bias` [B, 1, T, S] (`row_offset_bias`).

    The decode path of the rollout engine: the N / K query heads of one key/value head are stacked into
    one batched matmul, so the cache is read in place instead of being repeated per head (as SDPA's inputs
    would need), which dominates decode time for small models on CPU. The scale and the bias go on in one
    pass over the product's own memory (bias + scale x scores: scale x scores rounded once, then + 0 exact
    or -inf), the same numbers as scaling into a new tensor and filling the masked scores.
    """
    batch, num_heads, seq, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group_rows = num_heads // num_kv_heads * seq
    q = q.reshape(batch * num_kv_heads, group_rows, head_dim)  # [B*K, G*T, D], head n -> kv head n // G
    keys = k.reshape(batch * num_kv_heads, num_keys, head_dim)  # a view: the slot range is contiguous in B
    scores = torch.bmm(q, keys.transpose(1, 2))  # [B*K, G*T, S]
    scores = scores.view(batch, num_kv_heads, -1, seq, num_keys)  # [B, K, G, T, S], the same memory
    torch.add(bias[:, :, None], scores, alpha=head_dim**-0.5, out=scores)
    probs = torch.softmax(scores, dim=-1).view(batch * num_kv_heads, group_rows, num_keys)
    out = torch.bmm(probs, v.reshape(batch * num_kv_heads, num_keys, head_dim))  # [B*K, G*T, D]
    return out.view(batch, num_heads, seq, head_dim)


def row_offset_bias(
    key_mask: torch.Tensor, cache_offset: torch.Tensor, seq: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask [B, 1, T, S] for per-row offsets (0: attend, -inf: not): causal from each row's own offset,
    and key_mask [B, S]; a query always sees its own slot."""
    num_keys = key_mask.shape[1]
    query_slot = cache_offset[:, None] + torch.arange(seq, device=key_mask.device)  # [B, T]
    key_slot = torch.arange(num_keys, device=key_mask.device)  # [S]
    mask = key_slot[None, None, :] <= query_slot[:, :, None]  # [B, T, S]
    mask = (mask & key_mask.to(torch.bool)[:, None, :]) | (key_slot[None, None, :] == query_slot[:, :, None])
    bias = torch.zeros(mask.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill_(~mask, float("-inf"))[:, None]


def attention_mask(
    key_mask: torch.Tensor | None,
    batch: int,
    seq: int,
    cache_offset: int,
    has_cache: bool,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, S] (True = attend), or None when plain causal attention is exact."""
    if key_mask is None and not has_cache:
        return None
    num_keys = cache_offset + seq
    if key_mask is not None and tuple(key_mask.shape) != (batch, num_keys):
        raise ValueError(
            f"key_mask shape {tuple(key_mask.shape)} must be [B, S] = [{batch}, {num_keys}] "
            "(S = cache_offset + T)"
        )
    query_slot = torch.arange(cache_offset, num_keys, device=device)[:, None]  # [T, 1]
    key_slot = torch.arange(num_keys, device=device)[None, :]  # [1, S]
    causal = key_slot <= query_slot  # [T, S]
    if key_mask is None:
        return causal[None, None].expand(batch, 1, seq, num_keys)
    mask = causal[None] & key_mask.to(torch.bool)[:, None, :]  # [B, T, S]
    mask = mask | (key_slot == query_slot)[None]
    return mask[:, None]
