"""Context parallelism (actor.cp, critic.cp, distill.cp): one sequence split over the cp ranks of a data-parallel
rank.

Shape letters: B rows, N query heads, K key/value heads, G = N / K, D head dim, T tokens of the padded
sequence, c = T / (2 cp) tokens of one chunk, Tl = 2c tokens on one rank.

Layout (zig-zag, for causal load balance): the sequence, padded on the right to a multiple of 2 cp, is cut in
2 cp chunks; cp rank r holds chunks r and 2 cp - 1 - r, in that order. Under a causal mask chunk i attends
chunks 0..i, so rank r's two chunks attend (r + 1) + (2 cp - r) = 2 cp + 1 chunks whatever r is: every rank
does the same attention work. Rotary positions are each token's global position (`zigzag_positions`).

    T = 8 tokens, cp = 2:   chunks  [0 1][2 3][4 5][6 7]
                            rank 0 holds chunks 0, 3 -> positions 0 1 6 7
                            rank 1 holds chunks 1, 2 -> positions 2 3 4 5

Attention (`ring_attention`): ring passing of keys and values with an online softmax. Step s, rank r attends
its queries over the keys and values of rank r - s (their block's output and log-sum-exp merged into a running
output, flash-style), while that block travels on to rank r + 1; after cp steps every query has seen every
key. A block pair is skipped when the key chunk comes after the query chunk, computed causally when it is the
same chunk, and whole otherwise. The backward runs the same ring: each block's key and value gradients travel
with it and reach their owner after the last step (one more shift). Scores, softmax and accumulators are fp32.

Everything else in a decoder layer is per token, so it runs on the rank's Tl tokens unchanged. The LM head and
the log-probs run per chunk on each rank's own scored positions; `cp_sum` then adds the ranks' disjoint parts
of the [B, T-1] log-prob grid, so every cp rank holds the whole grid and computes the same loss (any
aggregation: token sums, per-row means, GSPO's sequence ratios) - see `cp_sum` for the gradient. A value model's
outputs (the critic's values at every position) go onto their grid the same way (`spread`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dockrl.models.decoder import Attention


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its context-parallel group: `rank` of `size`, and the group's global ranks in cp
    order (the ring's neighbours)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    global_ranks: tuple[int, ...]

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> ContextShard:
        """The shard of this process in `group`."""
        size = dist.get_world_size(group)
        ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
        return cls(group, dist.get_rank(group), size, ranks)

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunk indices (of 2 cp) that cp rank `rank` (default this one) holds."""
        r = self.rank if rank is None else rank
        return r, 2 * self.size - 1 - r


def padded_length(seq: int, cp: int) -> int:
    """The smallest multiple of 2 cp that holds `seq` tokens."""
    step = 2 * cp
    return -(-seq // step) * step


def zigzag_positions(seq: int, cp: int, rank: int) -> Tensor:
    """int64 [Tl]: the global positions cp rank `rank` holds of a sequence padded to `seq` (a multiple of 2 cp)."""
    assert seq % (2 * cp) == 0, f"pad the sequence to a multiple of 2 cp first ({seq}, cp={cp})"
    chunk = seq // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


def ring_attention(q: Tensor, k: Tensor, v: Tensor, shard: ContextShard) -> Tensor:
    """Causal attention of this rank's queries q [B, N, Tl, D] over the whole sequence's keys and values, of which
    this rank holds k, v [B, K, Tl, D] (zig-zag chunks, see the module docstring) -> [B, N, Tl, D] in q's dtype."""
    return _RingAttention.apply(q, k, v, shard)


class _CpSum(torch.autograd.Function):
    """Sum over the cp group in the forward; the gradient passes through unchanged (see `cp_sum`)."""

    @staticmethod
    def forward(ctx, part: Tensor, group: dist.ProcessGroup) -> Tensor:
        whole = part.clone()
        dist.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def cp_sum(part: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of the cp ranks' `part`s (disjoint positions of one grid, zeros elsewhere), on every cp rank.

    Gradient: every cp rank computes the same loss L from the same summed grid, and each backpropagates only
    through its own part, so the gradient of its part is dL/dgrid itself (not a sum over ranks). The ranks'
    parameter gradients then add up, over cp, to the single process's dL/dtheta (FSDP2 sums them over dp x cp)."""
    return _CpSum.apply(part, group)


def spread(local: Tensor, positions: Tensor, width: int, group: dist.ProcessGroup) -> Tensor:
    """The whole grid [B, width, ...] of per-position outputs from each cp rank's local [B, Tl, ...] at its global
    `positions` [Tl] (zigzag_positions): positions >= width (the right padding, and the last token when width is
    T - 1, the shifted grid) are dropped, the rest placed and summed over `group` (`cp_sum`: every cp rank holds
    the whole grid; each backpropagates through its own positions)."""
    keep = positions < width
    grid = local.new_zeros(local.shape[0], width, *local.shape[2:])
    return cp_sum(grid.index_copy(1, positions[keep], local[:, keep]), group)


# ---- ring attention ---------------------------------------------------------------------------------------


# Elements of one tile's [B, K, G t, c] fp32 score buffer (2^22: 16 MiB); the backward holds about three. The
# query rows of a chunk are cut in tiles of t rows so that the transient buffers stay this size whatever c is.
_TILE_ELEMENTS = 1 << 22


def _query_tiles(rows: int, batch: int, num_heads: int, keys: int) -> list[tuple[int, int]]:
    """[start, end) query rows of a chunk of `rows`, each tile's scores about _TILE_ELEMENTS elements."""
    size = max(1, _TILE_ELEMENTS // max(1, batch * num_heads * keys))
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def _block_scores(q_blk: Tensor, k_blk: Tensor, causal: bool, offset: int, rows: int) -> Tensor:
    """fp32 scores [B, K, G t, c] of t = `rows` query rows (grouped: [B, K, G t, D]) from row `offset` of their
    chunk over a key chunk [B, K, c, D]; -inf where the key comes after the query when `causal` (the same chunk on
    both sides)."""
    scores = torch.matmul(q_blk, k_blk.transpose(-1, -2)).mul_(q_blk.shape[-1] ** -0.5)
    if causal:
        device = q_blk.device
        query_pos = torch.arange(offset, offset + rows, device=device).repeat(q_blk.shape[2] // rows)  # [G t]
        future = torch.arange(k_blk.shape[2], device=device)[None, :] > query_pos[:, None]  # [G t, c]
        scores.masked_fill_(future, float("-inf"))
    return scores


def _visible(q_chunk: int, k_chunk: int) -> bool | None:
    """How a query chunk sees a key chunk: True whole, False causally (the same chunk), None not at all."""
    if k_chunk > q_chunk:
        return None
    return k_chunk < q_chunk


def _grouped(x: Tensor, num_kv_heads: int) -> Tensor:
    """[B, N, t, D] -> [B, K, G t, D] fp32: query head n reads key/value head n // G (transformers' order)."""
    batch, num_heads, seq, head_dim = x.shape
    return x.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads * seq, head_dim)


def _shift(tensor: Tensor, shard: ContextShard) -> tuple[Tensor, list]:
    """Start sending `tensor` to the next rank of the ring and receiving the previous rank's into a new buffer;
    returns the buffer and the requests to wait on."""
    received = torch.empty_like(tensor)
    nxt = shard.global_ranks[(shard.rank + 1) % shard.size]
    prev = shard.global_ranks[(shard.rank - 1) % shard.size]
    ops = [
        dist.P2POp(dist.isend, tensor, nxt, shard.group),
        dist.P2POp(dist.irecv, received, prev, shard.group),
    ]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, shard: ContextShard) -> Tensor:
        batch, num_heads, local, head_dim = q.shape
        num_kv_heads, chunk = k.shape[1], local // 2
        out = torch.zeros(batch, num_heads, local, head_dim, device=q.device)  # fp32 running output
        lse = torch.full((batch, num_heads, local), float("-inf"), device=q.device)  # fp32 running lse
        kv = torch.stack([k, v]).contiguous()  # [2, B, K, Tl, D], travels the ring as one message
        tiles = _query_tiles(chunk, batch, num_heads, chunk)
        for step in range(shard.size):
            pending: list = []
            if step < shard.size - 1:
                incoming, pending = _shift(kv, shard)
            for q_rows, cols, causal in _block_pairs(shard, step, chunk):
                keys, values = kv[0][:, :, cols].float(), kv[1][:, :, cols].float()  # [B, K, c, D]
                for start, end in tiles:
                    rows = slice(q_rows.start + start, q_rows.start + end)
                    q_blk = _grouped(q[:, :, rows], num_kv_heads)  # [B, K, G t, D]
                    scores = _block_scores(q_blk, keys, causal, start, end - start)
                    block_lse = torch.logsumexp(scores, dim=-1)  # [B, K, G t]
                    block_out = torch.matmul(scores.sub_(block_lse[..., None]).exp_(), values)
                    _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending:
                _wait(pending)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard = shard
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        shard: ContextShard = ctx.shard
        chunk = q.shape[2] // 2
        tiles = _query_tiles(chunk, q.shape[0], q.shape[1], chunk)
        delta = (grad_out.float() * out).sum(-1)  # [B, N, Tl]: rowsum(dout * out) = rowsum(p * dp)
        grad_q = torch.zeros(q.shape, device=q.device)  # fp32
        kv = torch.stack([k, v]).contiguous()
        grad_kv = torch.zeros(kv.shape, device=q.device)  # fp32, travels with its block
        for step in range(shard.size):
            pending: list = []
            if step < shard.size - 1:
                incoming, pending = _shift(kv, shard)
            for q_rows, cols, causal in _block_pairs(shard, step, chunk):
                for start, end in tiles:
                    rows = slice(q_rows.start + start, q_rows.start + end)
                    tile = _Tile(
                        q[:, :, rows], grad_out[:, :, rows], lse[:, :, rows], delta[:, :, rows], start
                    )
                    _tile_backward(
                        tile, kv[:, :, :, cols], causal, grad_q[:, :, rows], grad_kv[:, :, :, cols]
                    )
            if pending:
                _wait(pending)
                kv = incoming
            if shard.size > 1:  # the block's gradients go where the block goes (after the last step: home)
                grad_kv, requests = _shift(grad_kv, shard)
                _wait(requests)
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None


def _block_pairs(shard: ContextShard, step: int, chunk: int) -> list[tuple[slice, slice, bool]]:
    """At ring step `step` (this rank holds the keys of rank - step): (this rank's query rows, the held keys'
    columns, causal) of every chunk pair that attends - whole when the key chunk comes first, causal when it is
    the query's own chunk, left out when it comes after."""
    source = (shard.rank - step) % shard.size
    pairs = []
    for qi, q_chunk in enumerate(shard.chunks()):
        for ki, k_chunk in enumerate(shard.chunks(source)):
            whole = _visible(q_chunk, k_chunk)
            if whole is not None:
                pairs.append(
                    (slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk), not whole)
                )
    return pairs


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Online softmax: fold a tile's normalised output [B, K, G t, D] and log-sum-exp [B, K, G t] into the running
    out [B, N, t, D] and lse [B, N, t] (views, updated in place)."""
    block_lse = block_lse.reshape(lse.shape)
    merged = torch.logaddexp(lse, block_lse)
    out.mul_((lse - merged).exp_()[..., None]).add_(
        block_out.reshape(out.shape) * (block_lse - merged).exp_()[..., None]
    )
    lse.copy_(merged)


@dataclass(frozen=True)
class _Tile:
    """Query rows of one chunk from row `offset`: q, grad_out [B, N, t, D], and the whole rows' lse, delta [B, N, t]
    (so p below is the final softmax's)."""

    q: Tensor
    grad_out: Tensor
    lse: Tensor
    delta: Tensor
    offset: int


def _tile_backward(tile: _Tile, kv: Tensor, causal: bool, grad_q: Tensor, grad_kv: Tensor) -> None:
    """Add one tile's gradients over keys and values kv [2, B, K, c, D] into grad_q [B, N, t, D] and grad_kv
    [2, B, K, c, D] (fp32 views):

        p = exp(s - lse);  dv += p.T dout;  dp = dout v.T;  ds = p (dp - delta) / sqrt D;  dq += ds k;  dk += ds.T q
    """
    num_kv_heads, rows, head_dim = kv.shape[2], tile.q.shape[2], tile.q.shape[-1]
    q_blk, dout = _grouped(tile.q, num_kv_heads), _grouped(tile.grad_out, num_kv_heads)  # [B, K, G t, D]
    keys, values = kv[0].float(), kv[1].float()  # [B, K, c, D]
    probs = _block_scores(q_blk, keys, causal, tile.offset, rows)
    probs.sub_(tile.lse.reshape(*q_blk.shape[:3], 1)).exp_()  # [B, K, G t, c]
    grad_kv[1] += torch.matmul(probs.transpose(-1, -2), dout)
    dscores = torch.matmul(dout, values.transpose(-1, -2))  # dp
    dscores.sub_(tile.delta.reshape(*q_blk.shape[:3], 1)).mul_(probs).mul_(head_dim**-0.5)
    del probs
    grad_q += torch.matmul(dscores, keys).reshape(grad_q.shape)
    grad_kv[0] += torch.matmul(dscores.transpose(-1, -2), q_blk)


def attach(model: torch.nn.Module, shard: ContextShard) -> None:
    """Make every attention layer of `model` (a decoder's `model.layers[i].self_attn`) attend over the sequence
    split over `shard`'s group (ring attention); the rest of the model is per token and needs nothing."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.context_attention = functools.partial(ring_attention, shard=shard)


def local_sequence(input_ids: Tensor, shard: ContextShard, pad_token_id: int = 0) -> tuple[Tensor, Tensor]:
    """This rank's zig-zag share of input_ids [B, T], padded on the right to a multiple of 2 cp: ids [B, Tl] and
    their global positions [Tl]."""
    seq = input_ids.shape[1]
    padded = padded_length(seq, shard.size)
    ids = torch.nn.functional.pad(input_ids, (0, padded - seq), value=pad_token_id)  # [B, T']
    positions = zigzag_positions(padded, shard.size, shard.rank).to(input_ids.device)  # [Tl]
    return ids[:, positions], positions


@dataclass(frozen=True)
class LocalTokens:
    """What this cp rank runs of a micro-batch [B, T]: input_ids [B, Tl] at the global `positions` [Tl], and
    which of its hidden states are scored: `hidden_index` into its flat [B Tl] positions, `grid_index` into the
    flat [B (T-1)] log-prob grid, `targets` (the next tokens) [n] each."""

    input_ids: Tensor
    positions: Tensor
    hidden_index: Tensor
    grid_index: Tensor
    targets: Tensor


def local_tokens(
    input_ids: Tensor, scored: Tensor, shard: ContextShard, pad_token_id: int = 0
) -> LocalTokens:
    """This rank's share of input_ids [B, T] whose scored positions are `scored` (int64 [N] into the flat
    [B (T-1)] grid: position t predicts token t + 1). The sequence is padded on the right to a multiple of 2 cp
    with `pad_token_id` (causal attention: a pad never reaches a real token) and cut zig-zag."""
    rows, seq = input_ids.shape
    width, padded = seq - 1, padded_length(seq, shard.size)
    ids = torch.nn.functional.pad(input_ids, (0, padded - seq), value=pad_token_id)  # [B, T']
    local_ids, positions = local_sequence(input_ids, shard, pad_token_id)  # [B, Tl], [Tl]
    is_scored = torch.zeros(rows * width + 1, dtype=torch.bool, device=input_ids.device)
    is_scored[scored] = True
    grid = torch.arange(rows, device=ids.device)[:, None] * width + positions[None, :]  # [B, Tl]
    inside = positions[None, :] < width
    grid = torch.where(inside, grid, rows * width)  # the padding's past the grid: index of the False sentinel
    local_scored = is_scored[grid].reshape(-1)  # [B Tl]
    hidden_index = local_scored.nonzero().squeeze(-1)
    grid_index = grid.reshape(-1)[hidden_index]
    next_ids = ids[:, 1:].gather(1, positions.clamp(max=padded - 2).expand(rows, -1))  # [B, Tl]
    return LocalTokens(local_ids, positions, hidden_index, grid_index, next_ids.reshape(-1)[hidden_index])
