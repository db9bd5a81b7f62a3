"""Causal self-attention for training and scoring (the decode path's attention over a KV cache is in decoder.py).

Shape letters: B batch rows, N query heads, K key/value heads, G = N / K query heads per key/value head,
T tokens, D head dim, c rows of B in one chunk, Tq / Tk query / key tokens of one block.

`causal_attention(q [B, N, T, D], k, v [B, K, T, D])` is torch's `scaled_dot_product_attention` (`sdpa`: grouped
queries without repeating keys) on every path but one: the backward pass in bf16 on a CPU, where torch's flash
kernel runs at a third of the speed of the same work as batched matmuls (one layer at B=28, N=8, K=4, T=143,
D=32 on the project's avx512_bf16 CPU: 114 ms against 55 ms forward + backward, `dockrl bench kernels`). There
`_CpuCausalAttention` keeps torch's forward and saves q, k, v and out (no probabilities); its backward works
like a flash kernel with whole key rows as blocks:

    per chunk of c rows, per query block [start, end) (keys [0, end): the masked triangle mostly skipped):
        p = softmax(q_g @ k.T * D^-0.5, causal)      fp32 scores of the bf16 values     [c K, G Tq, Tk]
        dv += p.T @ dout;  dp = dout @ v.T
        ds = p (dp - rowsum(dout * out)) * D^-0.5
        dq = ds @ k;  dk += ds.T @ q

The matmuls take bf16 inputs (fp32 accumulation inside the CPU kernel) except the scores' (fp32 operands);
softmax, ds and the dk / dv sums are fp32. Query heads are grouped per key/value head (head n reads key/value
head n // G, as transformers' repeat_kv orders them). The transient buffers of one block are a few
[c K, G Tq, Tk] fp32 tensors of about `_BLOCK_ELEMENTS` elements whatever B is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Elements of one block's [c K, G Tq, Tk] fp32 score buffer (2^22: 16 MiB); the backward holds about three.
_BLOCK_ELEMENTS = 1 << 22
# Query blocks per sequence in the backward: block j of Q attends keys [0, end of block j) only, so the
# masked upper triangle is mostly skipped ((Q + 1) / 2Q of the full score matrix is computed).
_QUERY_BLOCKS = 4


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """torch's attention of q [B, N, T, D] over k, v [B, K, S, D] (K divides N): under the boolean `mask`
    [B, 1, T, S] (True = attend), or causal over T = S tokens without one."""
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal softmax attention q [B, N, T, D] over k, v [B, K, T, D] (K divides N) -> [B, N, T, D]."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and torch.is_grad_enabled() and q.requires_grad:
        return _CpuCausalAttention.apply(q, k, v)
    return sdpa(q, k, v)


def packed_causal_attention(q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...]) -> Tensor:
    """Block-diagonal causal attention of packed sequences (padding-free micro-batches, engines/train/batch.py):
    q [1, N, S, D] over k, v [1, K, S, D] holding sequences end to end, sequence i at tokens
    [bounds[i], bounds[i + 1]) (S = bounds[-1]); a token sees the earlier tokens of its own sequence only.

    One `causal_attention` per distinct sequence length, the sequences of that length stacked as its batch: its
    cost is sum L_i^2 instead of the S^2 of one call under a block-diagonal mask, and each call keeps torch's
    kernels (and the CPU bf16 backward above). On the project's CPU one call per sequence beat one masked SDPA
    call in every case measured (docs/benchmarks.md, "Padding-free packing"); stacking the sequences of one
    length gives each row the very numbers of its own call (every row's attention is independent of the
    others in the batch: tests/unit/test_attention.py checks it bit for bit) for one call's fixed cost instead
    of one per row (256 rows of ~27 tokens: 512 autograd calls per layer pass otherwise)."""
    if len(bounds) == 2:
        return causal_attention(q, k, v)
    spans = list(zip(bounds[:-1], bounds[1:]))
    by_length: dict[int, list[int]] = {}
    for index, (start, end) in enumerate(spans):
        by_length.setdefault(end - start, []).append(index)
    parts: list[Tensor] = [q] * len(spans)  # each replaced below
    for members in by_length.values():

        def stacked(x: Tensor, members: list[int] = members) -> Tensor:
            return torch.cat([x[:, :, spans[i][0] : spans[i][1]] for i in members], dim=0)  # [n, H, L, D]

        out = causal_attention(stacked(q), stacked(k), stacked(v))
        for row, index in enumerate(members):
            parts[index] = out[row : row + 1]
    return torch.cat(parts, dim=2)


def _query_blocks(seq: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of the backward's query blocks (at most _QUERY_BLOCKS, at least 16 tokens)."""
    size = max(16, -(-seq // _QUERY_BLOCKS))
    return [(start, min(start + size, seq)) for start in range(0, seq, size)]


def _causal_bias(start: int, end: int, num_groups: int) -> Tensor:
    """[G Tq, Tk] fp32: 0 where query token start + (r mod Tq) may see key token j < end, -inf after it."""
    query_pos = torch.arange(start, end).repeat(num_groups)  # [G Tq]
    future = torch.arange(end)[None, :] > query_pos[:, None]  # [G Tq, Tk]
    return torch.zeros(future.shape).masked_fill_(future, float("-inf"))


def _block_probs(q_blk: Tensor, k_c: Tensor, bias: Tensor) -> Tensor:
    """Softmax probabilities [c K, G Tq, Tk] fp32 of a query block (grouped, fp32: [c K, G Tq, D]) over keys
    [0, Tk) of k_c [c K, T, D] fp32, under the block's `_causal_bias`.

    The scores are fp32 products of the bf16 values, as in the forward's kernel: a score rounded to bf16 would
    move each probability by up to 2^-9 x |score| relative, far more than bf16 rounding of the probability."""
    keys = k_c[:, : bias.shape[1]].transpose(1, 2)
    return torch.softmax(torch.baddbmm(bias, q_blk, keys, alpha=q_blk.shape[-1] ** -0.5), dim=-1)


class _CpuCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = sdpa(q, k, v)
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out = ctx.saved_tensors
        batch, num_heads, seq, head_dim = q.shape
        num_kv_heads = k.shape[1]
        groups = num_heads // num_kv_heads
        scale = head_dim**-0.5
        grad_q, grad_k, grad_v = (torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
        blocks = [(start, end, _causal_bias(start, end, groups)) for start, end in _query_blocks(seq)]
        # rowsum(dout * out) = rowsum(p * dp): the softmax backward's subtracted term, per query.
        delta = (grad_out.float() * out.float()).sum(-1)  # [B, N, T]
        step = max(1, min(batch, _BLOCK_ELEMENTS // max(1, num_heads * seq * seq // 2)))
        for first in range(0, batch, step):
            rows = slice(first, first + step)
            k_c = k[rows].reshape(-1, seq, head_dim)  # [c K, T, D]
            v_c = v[rows].reshape(-1, seq, head_dim)
            k_fp32 = k_c.float()
            q_c = q[rows].reshape(k_c.shape[0], groups, seq, head_dim)  # [c K, G, T, D]
            dout_c = grad_out[rows].reshape(q_c.shape)
            delta_c = delta[rows].reshape(k_c.shape[0], groups, seq)  # [c K, G, T]
            dk_c = torch.zeros(k_c.shape)  # fp32 sums over the query blocks
            dv_c = torch.zeros(v_c.shape)
            dq_c = torch.empty(q_c.shape, dtype=q.dtype)
            for start, end, bias in blocks:
                q_blk = q_c[:, :, start:end].reshape(k_c.shape[0], -1, head_dim)  # [c K, G Tq, D]
                dout_blk = dout_c[:, :, start:end].reshape(q_blk.shape)
                probs = _block_probs(q_blk.float(), k_fp32, bias)  # [c K, G Tq, Tk] fp32
                dv_c[:, :end] += torch.bmm(probs.to(v.dtype).transpose(1, 2), dout_blk)
                dprobs = torch.bmm(dout_blk, v_c[:, :end].transpose(1, 2))  # [c K, G Tq, Tk] bf16
                shift = delta_c[:, :, start:end].reshape(k_c.shape[0], -1, 1) * -scale  # [c K, G Tq, 1]
                dscores = (
                    torch.add(shift, dprobs, alpha=scale).mul_(probs).to(q.dtype)
                )  # p (dp - delta) / sqrt D
                del probs, dprobs
                dq_c[:, :, start:end] = torch.bmm(dscores, k_c[:, :end]).view(dq_c[:, :, start:end].shape)
                dk_c[:, :end] += torch.bmm(dscores.transpose(1, 2), q_blk)
            grad_q[rows] = dq_c.view(grad_q[rows].shape)
            grad_k[rows] = dk_c.view(grad_k[rows].shape)
            grad_v[rows] = dv_c.view(grad_v[rows].shape)
        return grad_q, grad_k, grad_v
