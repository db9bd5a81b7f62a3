"""Causal self-attention for training and scoring (the decode path's attention over a KV cache is in decoder.py).

Shape letters: B batch rows, N query heads, K key/value heads, G = N / K query heads per key/value head,
T tokens, D head dim, c rows of B in one chunk, Tq / Tk query / key tokens of one block.

`causal_attention(q [B, N, T, D], k, v [B, K, T, D])` is torch's `scaled_dot_product_attention` (`sdpa`: grouped
queries without repeating keys) on every path but one: the backward pass in bf16 on a CPU, where torch's flash
kernel runs at a third of the speed of the same work as batched matmuls (one layer at B=28, N=8, K=4, T=143,
D=32 on the project's avx512_bf16 CPU: 114 ms against 55 ms forward + backward, `dockrl bench kernels`), except
for sequences of AMX_FLASH_BACKWARD_TOKENS and more on a CPU with AMX tiles, where torch's kernel computes its
bf16 products on them and wins (below). There `_CpuCausalAttention` keeps torch's forward and saves q, k, v and
out (no probabilities); its backward works like a flash kernel with whole key rows as blocks:

    per chunk of c rows, per query block [start, end) (keys [0, end): the masked triangle mostly skipped):
        p = softmax(q_g @ k.T * D^-0.5, causal)      fp32 scores of the bf16 values     [c K, G Tq, Tk]
        dv += p.T @ dout;  dp = dout @ v.T
        ds = p (dp - rowsum(dout * out)) * D^-0.5
        dq = ds @ k;  dk += ds.T @ q

The matmuls take bf16 inputs (fp32 accumulation inside the CPU kernel) except the scores' (fp32 operands);
softmax, ds and the dk / dv sums are fp32. Query heads are grouped per key/value head (head n reads key/value
head n // G, as transformers' repeat_kv orders them). The transient buffers of one block are a few
[c K, G Tq, Tk] fp32 tensors of about `_BLOCK_ELEMENTS` elements whatever B is.

Where the native kernels load (models/native, `native.available()`), that backward is one C call per layer
instead (models/native/attention.c: the same steps, all in fp32 in registers-sized blocks, rounded to bf16 once):
1.9x torch's ops at 8 rows of 147 tokens, 1.8x torch's flash backward at 512-640 tokens (one layer, one thread:
docs/benchmarks.md), so on an AMX CPU torch's flash backward takes over only from AMX_FLASH_OVER_NATIVE_TOKENS.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from dockrl.models import native

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


# From this many tokens per sequence torch's flash backward beats `_CpuCausalAttention` on a CPU with AMX tiles
# (one thread, 8 query and 4 key/value heads of 32: ours 1.15x faster at 512 tokens, even at 640, flash 1.8x
# faster at 768 and 2.3x at 2,048, where ours computes 5/8 of the fp32 score matrix without AMX).
AMX_FLASH_BACKWARD_TOKENS = 640
# The same against the native backward (one thread, 8 query and 4 key/value heads of 32, bf16: native 1.8x faster
# at 640 tokens, even at 896, flash 1.2x faster at 1,024 and 1.4x at 2,048).
AMX_FLASH_OVER_NATIVE_TOKENS = 896


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal softmax attention q [B, N, T, D] over k, v [B, K, T, D] (K divides N) -> [B, N, T, D]."""
    trained_in_bf16_on_cpu = (
        q.device.type == "cpu" and q.dtype == torch.bfloat16 and torch.is_grad_enabled() and q.requires_grad
    )
    flash_from = AMX_FLASH_OVER_NATIVE_TOKENS if _native_backward() else AMX_FLASH_BACKWARD_TOKENS
    if trained_in_bf16_on_cpu and not (q.shape[2] >= flash_from and _has_amx()):
        return _CpuCausalAttention.apply(q, k, v)
    return sdpa(q, k, v)


def _native_backward() -> bool:
    """Whether `_CpuCausalAttention`'s backward is the native kernel (models/native/attention.c)."""
    return native.available()


@functools.cache
def _has_amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bf16 products there run on them)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def packed_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, bounds: tuple[int, ...], pad_waste: float | None = None
) -> Tensor:
    """Block-diagonal causal attention of packed sequences (padding-free micro-batches, engines/train/batch.py):
    q [1, N, S, D] over k, v [1, K, S, D] holding sequences end to end, sequence i at tokens
    [bounds[i], bounds[i + 1]) (S = bounds[-1]); a token sees the earlier tokens of its own sequence only.

    The sequences go in buckets of like lengths (`length_buckets`), one `causal_attention` per bucket with its
    sequences stacked as the batch, each right-padded to the bucket's longest: a pad comes after every real
    token of its row, so causal attention alone keeps it unseen, and its output (and so its gradient) is
    dropped. A bucket's cost is its rows x its longest^2 instead of the S^2 of one call under a block-diagonal
    mask, and each call keeps torch's kernels (and the CPU bf16 backward above). A call has a fixed cost of
    its own (a few ms forward and backward on the project's CPU), so rows of ~27 tokens cost less padded into
    one or two buckets than in one call per distinct length (128 rows of 17-27 tokens: 3x faster, bf16 and
    fp32; docs/benchmarks.md, "Padding-free packing"), while long rows of spread lengths keep buckets of
    their own (padding would cost more than the calls). A bucket of equal lengths gives each row the very
    numbers of its own call (rows of a batch are independent: tests/unit/test_attention.py checks it bit for
    bit); a padded row's numbers equal its own call's up to the kernels' summation order."""
    if len(bounds) == 2:
        return causal_attention(q, k, v)
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    total, device = bounds[-1], q.device
    padded: list[Tensor] = []  # token-major [S + 1, H, D] with a zero token at S, which every pad reads
    outs, order = (
        [],
        [],
    )  # per bucket: its outputs token-major [sum L, N, D], and their tokens' packed indices
    for rows in length_buckets(lengths, PAD_WASTE if pad_waste is None else pad_waste):
        if len(rows) == 1:  # a row alone: its own tokens, nothing to gather
            start, end = bounds[rows[0]], bounds[rows[0] + 1]
            out = causal_attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end])
            outs.append(out[0].transpose(0, 1))
            order.append(torch.arange(start, end, device=device))
            continue
        if not padded:
            padded = [torch.cat([x[0].transpose(0, 1), x.new_zeros(1, *x.shape[1::2])]) for x in (q, k, v)]
        width = max(lengths[i] for i in rows)
        starts = torch.tensor([bounds[i] for i in rows], device=device)[:, None]
        sizes = torch.tensor([lengths[i] for i in rows], device=device)[:, None]
        offsets = torch.arange(width, device=device)[None, :]
        gather = torch.where(offsets < sizes, starts + offsets, total).view(-1)  # [n W] slot -> token, S: pad
        real = (gather < total).nonzero().squeeze(1)  # [sum L] the real slots, row by row
        stacked = [
            x.index_select(0, gather).view(len(rows), width, *x.shape[1:]).transpose(1, 2) for x in padded
        ]  # [n, H, W, D]
        out = causal_attention(*stacked)  # [n, N, W, D]
        outs.append(out.transpose(1, 2).reshape(-1, *out.shape[1::2]).index_select(0, real))  # [sum L, N, D]
        order.append(gather[real])
    packed = torch.cat(outs) if len(outs) > 1 else outs[0]  # [S, N, D] tokens in bucket order
    position = torch.empty(total, dtype=torch.long, device=device)
    position[torch.cat(order)] = torch.arange(
        total, device=device
    )  # where each packed token sits in `packed`
    return packed.index_select(0, position).transpose(0, 1)[None]  # [1, N, S, D]


# A bucket of packed_causal_attention may compute this many times its rows' own attention scores (rows x its
# longest^2 over sum L_i^2): the padding it computes against the fixed cost of one more call.
PAD_WASTE = 1.5


def length_buckets(lengths: list[int], pad_waste: float = PAD_WASTE) -> list[list[int]]:
    """Row indices in buckets of like lengths, each row in one: rows taken shortest first (ties in order), a
    row joining the current bucket while that bucket's rows x its longest^2 stays within `pad_waste` x the sum
    of its rows' own lengths^2 (1: rows of one length only, nothing padded)."""
    buckets: list[list[int]] = []
    squares = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        square = lengths[i] ** 2
        if buckets and (len(buckets[-1]) + 1) * square <= pad_waste * (squares + square):
            buckets[-1].append(i)
            squares += square
        else:
            buckets.append([i])
            squares = square
    return buckets


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
        if _native_backward():  # the same steps in one C call (the module docstring)
            return native.attention_backward(q, k, v, out, grad_out.contiguous())
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
