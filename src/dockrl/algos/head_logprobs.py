"""Log-probabilities and entropies straight from hidden states and the LM head, chunk by chunk over tokens.

Shape letters: N tokens (rows of a micro-batch flattened), H hidden size, V vocabulary (Vl = V / tp: this rank's
vocab slice under tensor parallelism), c tokens in one chunk.

`head_token_stats(hidden [N, H], weight [Vl, H], targets [N])` returns the log-probability of each target and the
entropy of each position under softmax(hidden @ weight.T / temperature) without ever holding the [N, V] logits:

    forward, per chunk of c tokens:   z = (h_c @ W.T).float() / temperature                      [c, Vl]
                                      lse, z[target], sum(softmax(z) * z)  (all-reduced over tp)  [c] each
                                      keep lse and sum(p z) only                                   [N] each
    backward, per chunk (z recomputed, a second matmul instead of N x V saved logits):
                                      p = exp(z - lse)
                                      dz = g_logp (onehot(target) - p) - g_H p (z - sum p z)        [c, Vl]
                                      grad_h_c = dz @ W      grad_W += dz.T @ h_c

So the memory above the inputs, the head weight and its gradient is a few [c, Vl] fp32 buffers, whatever N is;
`chunk_tokens` makes c * Vl about `_CHUNK_ELEMENTS`. Under tensor parallelism `group` is the tp group: each rank
computes its slice, the per-token statistics are all-reduced, and the hidden states' gradient is this rank's
part (the caller's copy_to_tp sums it over ranks, as for the plain LM head).

The matmuls run in the dtype the LM head would (the weight's, or autocast's when autocast is on), the softmax
statistics in fp32: the values are those of `token_logprobs(F.linear(h, W))` up to summation order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# Elements of one [c, Vl] fp32 chunk (2^21: 8 MiB, cache-sized). Backward holds about three such buffers at once.
# A chunk keeps at least _MIN_CHUNK_TOKENS tokens, so the head's matmuls keep enough rows at a large vocabulary.
# Measured fp32 on this project's 2-core CPU (N 8192, H 256, forward + backward, 2026-12-03): at V 8000, 2^25
# elements (4194 tokens) 1.51 s, 2^21 (262) ~1.33 s, 2^20 (131) 1.29 s, 32 tokens 1.74 s; at V 32000, 1048
# tokens 6.7 s, 131 tokens 6.8 s, 32 tokens 11.3 s, 16 tokens 20 s (the old floor of 16 was far too small).
_CHUNK_ELEMENTS = 1 << 21
_MIN_CHUNK_TOKENS = 128


def chunk_tokens(vocab: int, elements: int = _CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so one [c, vocab] fp32 buffer holds about `elements` elements (at least 128 tokens)."""
    return max(_MIN_CHUNK_TOKENS, elements // max(vocab, 1))


def head_token_stats(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(log-probs [N], entropies [N]) fp32 of `targets` [N] under softmax(hidden [N, H] @ weight [Vl, H].T / T).

    Differentiable w.r.t. `hidden` and `weight`. `vocab_start`: the first id of this rank's vocab slice and
    `group` the tp group (None: the whole vocabulary is here). `chunk`: tokens per chunk (default: about
    `_CHUNK_ELEMENTS / Vl`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    compute = _compute_dtype(hidden, weight)
    return _HeadTokenStats.apply(
        hidden,
        weight,
        targets.long(),
        temperature,
        vocab_start,
        group,
        chunk or chunk_tokens(weight.shape[0]),
        compute,
    )


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) would compute in here (autocast's when it is on)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _HeadTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_start, group, chunk, compute):
        ctx.set_materialize_grads(False)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute), weight.to(compute)
            logp, lse, mean_z = (torch.empty(h.shape[0], device=h.device) for _ in range(3))  # [N] fp32 each
            for start in range(0, h.shape[0], chunk):
                tokens = slice(start, start + chunk)
                stats = _chunk_stats(h[tokens], w, targets[tokens], temperature, vocab_start, group)
                logp[tokens], lse[tokens], mean_z[tokens] = stats
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.args = (temperature, vocab_start, chunk, compute)
        return logp, lse - mean_z

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        temperature, vocab_start, chunk, compute = ctx.args
        grad_hidden = grad_weight = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute), weight.to(compute)
            if ctx.needs_input_grad[0]:
                grad_hidden = torch.empty_like(h)
            if ctx.needs_input_grad[1]:  # summed over chunks in fp32
                grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for start in range(0, h.shape[0], chunk):
                tokens = slice(start, start + chunk)
                dz = _chunk_grad(
                    h[tokens],
                    w,
                    targets[tokens],
                    lse[tokens],
                    mean_z[tokens],
                    temperature,
                    vocab_start,
                    None if grad_logp is None else grad_logp[tokens],
                    None if grad_entropy is None else grad_entropy[tokens],
                ).to(compute)
                if grad_hidden is not None:
                    grad_hidden[tokens] = dz @ w
                if grad_weight is not None:
                    if compute == torch.float32:
                        grad_weight.addmm_(dz.T, h[tokens])
                    else:
                        grad_weight += dz.T @ h[tokens]
                del dz  # before the next chunk's buffers exist
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _chunk_logits(h: Tensor, w: Tensor, temperature: float) -> Tensor:
    """fp32 logits / temperature of one chunk [c, Vl] (a fresh buffer, safe to modify in place)."""
    z = (h @ w.T).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _local_targets(targets: Tensor, vocab_start: int, local_vocab: int) -> tuple[Tensor, Tensor]:
    """Targets as indices into this rank's slice (clamped) and whether each falls in it."""
    local = targets - vocab_start
    inside = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), inside


def _chunk_stats(h, w, targets, temperature, vocab_start, group) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, lse, sum p z) [c] of one chunk, all-reduced over `group`."""
    z = _chunk_logits(h, w, temperature)  # [c, Vl]
    peak = z.max(-1).values  # [c]
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    local, inside = _local_targets(targets, vocab_start, z.shape[-1])
    picked = z.gather(-1, local[:, None]).squeeze(-1) * inside  # [c]
    z.sub_(peak[:, None])  # z - m
    e = z.exp()  # [c, Vl]
    sum_exp = e.sum(-1)
    weighted = e.mul_(z).sum(-1)  # sum e^(z-m) (z-m)
    sums = torch.stack([sum_exp, picked, weighted])  # [3, c]
    if group is not None:
        dist.all_reduce(sums, group=group)
    sum_exp, picked, weighted = sums
    lse = peak + sum_exp.log()
    mean_z = weighted / sum_exp + peak  # sum p z
    return picked - lse, lse, mean_z


def _chunk_grad(h, w, targets, lse, mean_z, temperature, vocab_start, grad_logp, grad_entropy) -> Tensor:
    """d loss / d(h @ w.T) [c, Vl] fp32 of one chunk: (g_logp (onehot - p) - g_H p (z - sum p z)) / T."""
    z = _chunk_logits(h, w, temperature)  # [c, Vl]
    p = (z - lse[:, None]).exp_()  # [c, Vl]
    coef = z  # -dz / p, built in z's buffer: g_logp + g_H (z - sum p z)
    if grad_entropy is not None:
        coef.sub_(mean_z[:, None]).mul_(grad_entropy[:, None])
    else:
        coef.zero_()
    if grad_logp is not None:
        coef.add_(grad_logp[:, None])
    dz = p.mul_(coef).neg_()
    del z, coef
    if grad_logp is not None:
        local, inside = _local_targets(targets, vocab_start, dz.shape[-1])
        dz.scatter_add_(-1, local[:, None], (grad_logp * inside)[:, None])
    return dz.div_(temperature) if temperature != 1.0 else dz
