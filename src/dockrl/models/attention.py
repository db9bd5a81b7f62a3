"""Attention kernels of the decoder: causal self-attention for training and scoring, and the decode path's
grouped attention over a KV cache.

Shape letters: B batch rows, N query heads, K key/value heads, G = N / K query heads per key/value head,
T tokens (queries), S key slots, D head dim, c rows of B in one chunk.

`causal_attention(q [B, N, T, D], k, v [B, K, T, D])` is plain causal attention over T tokens. On CUDA, and in
fp32 anywhere, it is torch's `scaled_dot_product_attention` (flash / memory-efficient kernels). In bf16 on a CPU
it is `_CpuCausalAttention`, because torch's CPU flash kernel runs its bf16 backward at a third of the speed of
the same work done as batched matmuls (measured on the project's avx512_bf16 CPU: 100 ms against 45 ms for one
layer's forward and backward at B=25, N=8, K=4, T=160, D=32). It works like a flash kernel with whole rows of
keys as its blocks:

    forward, per chunk of c rows:   p = softmax((q_g @ k.T).float() * D^-0.5, causal)   [c K, G T, T] fp32
                                    out = p.bf16 @ v
                                    keeps q, k, v and out only (no probabilities)
    backward, per chunk:            p recomputed by the same code (one matmul more than storing p)
                                    dv = p.T @ dout;  dp = dout @ v.T
                                    ds = p (dp - rowsum(dout * out)) * D^-0.5
                                    dq = ds @ k;  dk = ds.T @ q

The matmuls take bf16 inputs (fp32 accumulation inside the CPU kernel); scores, softmax and ds are fp32. Query
heads are grouped per key/value head (head n reads key/value head n // G, as transformers' repeat_kv orders
them), so keys and values are never repeated per query head. The transient buffers of one chunk are a few
[c K, G T, T] fp32 tensors of about `_CHUNK_ELEMENTS` elements whatever B is.
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


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal softmax attention q [B, N, T, D] over k, v [B, K, T, D] (K divides N) -> [B, N, T, D]."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and torch.is_grad_enabled() and q.requires_grad:
        return _CpuCausalAttention.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _query_blocks(seq: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of the backward's query blocks (at most _QUERY_BLOCKS, at least 16 tokens)."""
    size = max(16, -(-seq // _QUERY_BLOCKS))
    return [(start, min(start + size, seq)) for start in range(0, seq, size)]


def _block_probs(q_blk: Tensor, k_c: Tensor, start: int, end: int, num_groups: int) -> Tensor:
    """Softmax probabilities [c K, G Tq, end] fp32 of query tokens [start, end) (grouped, fp32: [c K, G Tq, D])
    over keys [0, end) of k_c [c K, T, D] fp32, each query masked to the keys at or before it.

    The scores are fp32 products of the bf16 values, as in the forward's kernel: a score rounded to bf16 would
    move each probability by up to 2^-9 x |score| relative, far more than bf16 rounding of the probability."""
    scale = q_blk.shape[-1] ** -0.5
    query_pos = torch.arange(start, end, device=q_blk.device).repeat(num_groups)  # [G Tq]
    future = torch.arange(end, device=q_blk.device)[None, :] > query_pos[:, None]  # [G Tq, Tk]
    bias = torch.zeros(future.shape, device=q_blk.device).masked_fill_(future, float("-inf"))
    scores = torch.baddbmm(bias, q_blk, k_c[:, :end].transpose(1, 2), alpha=scale)  # [c K, G Tq, Tk]
    return torch.softmax(scores, dim=-1)


class _CpuCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out = ctx.saved_tensors
        batch, num_heads, seq, head_dim = q.shape
        num_kv_heads = k.shape[1]
        groups = num_heads // num_kv_heads
        scale = head_dim**-0.5
        grad_q = torch.empty(q.shape, dtype=q.dtype)
        grad_k = torch.empty(k.shape, dtype=k.dtype)
        grad_v = torch.empty(v.shape, dtype=v.dtype)
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
            for start, end in _query_blocks(seq):
                q_blk = q_c[:, :, start:end].reshape(k_c.shape[0], -1, head_dim)  # [c K, G Tq, D]
                dout_blk = dout_c[:, :, start:end].reshape(q_blk.shape)
                probs = _block_probs(q_blk.float(), k_fp32, start, end, groups)  # [c K, G Tq, Tk] fp32
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
