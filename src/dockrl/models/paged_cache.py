"""Paged key/value cache of the rollout engine: a pool of fixed-size blocks handed to sequences as they grow.

```
 per layer: k, v [K, num_blocks, block_size, D]      block 0: the idle rows' scratch block (never handed out)
 block table [B, M] int64 per decode row: sequence position p lives in block table[b, p // block_size],
                                          at offset p % block_size; unused entries point at block 0
 write : the T new keys of row b go to its positions [offset_b, offset_b + T)
 read  : index_select of the row's first ceil(S / block_size) blocks -> [K, B, S, D] (one copy of the keys
         attended, into a buffer reused every step), then grouped attention over it
```

The pool grows by doubling (one copy of the blocks in use) up to `max_blocks`, so its memory follows the
longest-running demand instead of every slot's worst case; `allocate` hands out blocks, `release` takes them
back. Which sequence owns which block is the caller's bookkeeping (engines/rollout/rollout_engine.py).

Shape letters: B decode rows, N query heads, K key/value heads, G = N / K, T new tokens per row, S key
positions attended, D head dim, M blocks per row in the table.
"""

from __future__ import annotations

import torch

from dockrl.models.config import ModelArgs


class PagedKVCache:
    """Blocks of `block_size` key/value positions for every layer, allocated on demand up to `max_blocks`.

    Lifecycle: built once per engine with room for `initial_blocks`; `allocate` grows the pool (doubling, at
    most `max_blocks` plus the scratch block) when its free blocks run out; blocks return with `release`.
    """

    def __init__(
        self,
        args: ModelArgs,
        block_size: int,
        initial_blocks: int,
        max_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        assert 1 <= initial_blocks <= max_blocks, (initial_blocks, max_blocks)
        self.block_size, self.max_blocks = block_size, max_blocks
        self.block_shape = (args.num_kv_heads, block_size, args.head_dim)
        self.num_layers, self.dtype, self.device = args.num_layers, dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._resize(initial_blocks + 1)
        self.free = list(range(initial_blocks, 0, -1))  # a stack; block 0 is the scratch block
        self.peak_used = 0
        # The keys and values one layer attends, gathered each decode step into the same two buffers: a fresh
        # tensor of that size each time costs the page faults of fresh memory (on a CPU, more than the copy).
        self._gathered = [torch.empty(0, dtype=dtype, device=device) for _ in range(2)]

    @property
    def capacity(self) -> int:
        """Blocks allocated in memory, the scratch block excluded."""
        return self.k[0].shape[1] - 1

    def num_obtainable(self) -> int:
        """Blocks `allocate` can still hand out: the free ones and those the pool may grow by."""
        return len(self.free) + self.max_blocks - self.capacity

    def num_used(self) -> int:
        """Blocks held by sequences."""
        return self.capacity - len(self.free)

    def nbytes(self) -> int:
        """Bytes the pool holds now (keys and values of every layer, scratch block included)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def block_bytes(self) -> int:
        """Bytes of one block over all layers, keys and values."""
        return (
            2
            * self.num_layers
            * self.block_shape[0]
            * self.block_shape[1]
            * self.block_shape[2]
            * (torch.empty((), dtype=self.dtype).element_size())
        )

    def allocate(self, count: int) -> list[int]:
        """`count` free block ids (callers check `num_obtainable` first); grows the pool when needed."""
        assert count <= self.num_obtainable(), (count, self.num_obtainable())
        if count > len(self.free):
            old = self.capacity
            new = min(self.max_blocks, max(2 * old, old + count - len(self.free)))
            self._resize(new + 1)
            self.free = list(range(new, old, -1)) + self.free
        blocks = [self.free.pop() for _ in range(count)]
        self.peak_used = max(self.peak_used, self.num_used())
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Give blocks back to the pool (their contents are stale and never read)."""
        self.free.extend(blocks)

    def gather(
        self, blocks: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of positions [0, num_keys) of every row of block_table [B, M]: each
        [K B, S, D] (rows K-major), views of this cache's gather buffers, valid until the next gather."""
        num_kv_heads, _, block_size, head_dim = blocks[0].shape
        batch, num_blocks = block_table.shape[0], -(-num_keys // block_size)
        index = block_table[:, :num_blocks].reshape(-1)  # [B M']
        shape = (num_kv_heads, batch * num_blocks, block_size, head_dim)
        size = shape[0] * shape[1] * block_size * head_dim
        gathered = []
        for which, source in enumerate(blocks):
            if self._gathered[which].numel() < size:
                self._gathered[which] = torch.empty(2 * size, dtype=self.dtype, device=self.device)
            out = self._gathered[which][:size].view(shape)
            torch.index_select(source, 1, index, out=out)
            gathered.append(out.view(num_kv_heads * batch, num_blocks * block_size, head_dim)[:, :num_keys])
        return gathered[0], gathered[1]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What one attention layer gets: its (key blocks, value blocks) [K, num_blocks, block_size, D]."""
        return self.k[index], self.v[index]

    def _resize(self, num_blocks: int) -> None:
        """Reallocate every layer's blocks to `num_blocks`, keeping the blocks already there."""
        shape = (self.block_shape[0], num_blocks, *self.block_shape[1:])
        for pool in (self.k, self.v):
            for index in range(self.num_layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if index < len(pool):
                    grown[:, : pool[index].shape[1]] = pool[index]
                    pool[index] = grown
                else:
                    pool.append(grown)


def write_blocks(
    blocks: tuple[torch.Tensor, torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    row_offsets: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """Write k, v [B, K, T, D] of row b at its positions row_offsets[b] + t, through its block table [B, M]."""
    cache_k, cache_v = blocks
    block_size = cache_k.shape[2]
    positions = row_offsets[:, None] + torch.arange(k.shape[2], device=k.device)  # [B, T]
    block = block_table.gather(1, positions // block_size)  # [B, T]
    offset = positions % block_size
    # Advanced indices on dims 1 and 2 around the leading slice: the indexed view is [K, B, T, D].
    cache_k[:, block, offset] = k.transpose(0, 1)
    cache_v[:, block, offset] = v.transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, batch: int
) -> torch.Tensor:
    """Softmax attention of q [B, N, T, D] over gathered k, v [K B, S, D] (`PagedKVCache.gather`) under the
    additive `bias` [B, 1, T, S] (kv_cache.row_offset_bias).

    The N / K query heads of one key/value head are stacked into one batched matmul (keys are not repeated per
    head), with the batch K-major as the gather leaves it; each (row, head) product is the same as over a
    contiguous cache (kv_cache.grouped_attention), scale and bias applied the same way.
    """
    _, num_heads, seq, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[0] // batch, k.shape[1]
    group_rows = num_heads // num_kv_heads * seq
    q = q.reshape(batch, num_kv_heads, group_rows, head_dim).transpose(0, 1)  # head n -> kv head n // G
    q = q.reshape(num_kv_heads * batch, group_rows, head_dim)  # [K B, G T, D]
    scores = torch.bmm(q, k.transpose(1, 2)).view(num_kv_heads, batch, -1, seq, num_keys)  # [K, B, G, T, S]
    torch.add(bias[None], scores, alpha=head_dim**-0.5, out=scores)
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads * batch, group_rows, num_keys)
    out = torch.bmm(probs, v)  # [K B, G T, D]
    out = out.view(num_kv_heads, batch, group_rows, head_dim).transpose(0, 1)
    return out.reshape(batch, num_heads, seq, head_dim)
