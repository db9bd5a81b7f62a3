"""Log-probabilities and entropies straight from hidden states and the LM head, chunk by chunk over tokens.

Shape letters: N tokens (rows of a micro-batch flattened), H hidden size, V vocabulary (Vl = V / tp: this rank's
vocab slice under tensor parallelism), c tokens in one chunk.

`head_token_stats(hidden [N, H], weight [Vl, H], targets [N])` returns the log-probability of each target and the
entropy of each position under softmax(hidden @ weight.T / temperature) without ever holding the [N, V] logits
(`head_support_stats` adds the log-probs of k more ids per position, top-k distillation's support [N, k], from the
same logsumexp; `head_top_k` is the teacher's side, no grad: its k most likely ids and their log-probs):

    forward, per chunk of c tokens:   z = (h_c @ W.T).float() / temperature                      [c, Vl]
                                      lse, z[target], sum(softmax(z) * z)  (all-reduced over tp)  [c] each
                                      keep lse and sum(p z) only                                   [N] each
    backward, per chunk (z recomputed, a second matmul instead of N x V saved logits):
                                      p = exp(z - lse)
                                      dz = sum_j g_j (onehot(id_j) - p) - g_H p (z - sum p z)      [c, Vl]
                                      (j over the scored ids of a position: its target [, its support])
                                      grad_h_c = dz @ W      grad_W += dz.T @ h_c

So the memory above the inputs, the head weight and its gradient is a few [c, Vl] fp32 buffers, whatever N is;
`chunk_tokens` makes c * Vl about `_CHUNK_ELEMENTS`. Under tensor parallelism `group` is the tp group: each rank
computes its slice, the per-token statistics are all-reduced, and the hidden states' gradient is this rank's
part (the caller's copy_to_tp sums it over ranks, as for the plain LM head).

The matmuls run in the dtype the LM head would (the weight's, or autocast's when autocast is on), the softmax
statistics in fp32: the values are those of `token_logprobs(F.linear(h, W))` up to summation order.

`kernels` (a `HeadKernels`: models/native/head.py's, which the training engine passes on a CPU) does the
per-chunk softmax work above in C, one pass over the matmul's own output for each of the forward's maximum and
sums and the backward's dz (written in the logits' place, in the compute dtype), instead of torch's ~10 passes
over an fp32 copy: the same per-element math (x / T taken as x times the rounded 1 / T), the sums in another
order, glibc's exp for torch's (models/native/head.c; tests/unit/test_head_logprobs.py bounds the difference).
"""

from __future__ import annotations

from typing import Protocol

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


class HeadKernels(Protocol):
    """The per-chunk softmax work of the fused head, natively (models/native/head.py implements it). z is a
    chunk's matmul output [c, Vl] (fp32 or bf16), x = z / temperature."""

    def peak(self, z: Tensor, temperature: float) -> Tensor:
        """max_j x_j per row, fp32 [c]."""
        ...

    def sums(self, z: Tensor, temperature: float, peak: Tensor) -> tuple[Tensor, Tensor]:
        """(sum_j e^(x_j - peak), sum_j e^(x_j - peak) (x_j - peak)) per row, fp32 [c] each."""
        ...

    def grad_(
        self,
        z: Tensor,
        temperature: float,
        lse: Tensor,
        mean_z: Tensor,
        grad_entropy: Tensor | None,
        grad_logp: Tensor | None,
        ids: Tensor,
    ) -> Tensor:
        """`_chunk_grad`'s dz from z, in z's dtype, written over z; ids [c, m] local (-1: not in the slice)."""
        ...

    def accumulate_(self, dst: Tensor, src: Tensor) -> None:
        """dst (fp32) += src."""
        ...


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
    kernels: HeadKernels | None = None,
) -> tuple[Tensor, Tensor]:
    """(log-probs [N], entropies [N]) fp32 of `targets` [N] under softmax(hidden [N, H] @ weight [Vl, H].T / T).

    Differentiable w.r.t. `hidden` and `weight`. `vocab_start`: the first id of this rank's vocab slice and
    `group` the tp group (None: the whole vocabulary is here). `chunk`: tokens per chunk (default: about
    `_CHUNK_ELEMENTS / Vl`). `kernels`: the softmax work natively (the module docstring); None: torch's ops.
    """
    _check_args(hidden, targets, temperature)
    logp, entropy = _scored_stats(
        hidden, weight, targets[:, None], temperature, vocab_start, group, chunk, kernels
    )
    return logp[:, 0], entropy


def head_support_stats(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    support: Tensor,
    temperature: float = 1.0,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk: int | None = None,
    kernels: HeadKernels | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """As `head_token_stats`, plus the log-probs [N, k] fp32 of `support` [N, k] (global ids: the teacher's
    top-k at each position), all from one logsumexp per position and differentiable alike."""
    _check_args(hidden, targets, temperature)
    if support.dim() != 2 or support.shape[0] != targets.shape[0]:
        raise ValueError(f"support must be [N, k] with N = {targets.shape[0]}; got {tuple(support.shape)}")
    ids = torch.cat([targets[:, None].long(), support.long()], dim=-1)  # [N, 1 + k]
    logp, entropy = _scored_stats(hidden, weight, ids, temperature, vocab_start, group, chunk, kernels)
    return logp[:, 0], entropy, logp[:, 1:]


@torch.no_grad()
def head_top_k(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    k: int,
    temperature: float = 1.0,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk: int | None = None,
    num_ids: int | None = None,
    kernels: HeadKernels | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs of `targets` [N], the k most likely ids [N, k] int64, their log-probs [N, k]) fp32 under
    softmax(hidden @ weight.T / T), most likely first; no grad (the teacher's side of top-k distillation).
    `num_ids`: the top-k are among ids < num_ids (the student's vocabulary, where a teacher's embedding has
    more rows); the log-probs are still under the teacher's whole softmax.

    Under tensor parallelism each rank takes the top min(k, Vl) of its slice (a global top-k id is in its
    rank's local top-k), the candidates [c, tp x min(k, Vl)] are all-gathered and the top-k of them kept: every
    rank ends with the same ids, those of the unsplit vocabulary (up to the order of exactly tied logits).
    `kernels`: the statistics natively, as in `head_token_stats`."""
    _check_args(hidden, targets, temperature)
    tp = 1 if group is None else dist.get_world_size(group)
    num_ids = weight.shape[0] * tp if num_ids is None else min(num_ids, weight.shape[0] * tp)
    if not 0 < k <= num_ids:
        raise ValueError(f"k must be in [1, {num_ids}] (the ids it is chosen among); got {k}")
    chunk = chunk or chunk_tokens(weight.shape[0])
    compute = _compute_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.to(compute), weight.to(compute)
        num = h.shape[0]
        logp = torch.empty(num, device=h.device)  # [N]
        top_ids = torch.empty(num, k, dtype=torch.long, device=h.device)  # [N, k]
        top_logp = torch.empty(num, k, device=h.device)  # [N, k]
        for start in range(0, num, chunk):
            tokens = slice(start, start + chunk)
            if kernels is None:
                z = _chunk_logits(h[tokens], w, temperature)  # [c, Vl]
                values, ids = _gathered_top_k(z, k, vocab_start, group, num_ids)  # [c, k] each
                picked, lse, _ = _logit_stats(z, targets[tokens, None], vocab_start, group)  # z is spent
            else:  # the top-k of z, then / T (the same order: T > 0), and the statistics by the kernels
                z = h[tokens] @ w.T  # [c, Vl]
                values, ids = _gathered_top_k(z, k, vocab_start, group, num_ids)
                values = values.float() / temperature if temperature != 1.0 else values.float()
                picked, lse, _ = _native_stats(
                    z, targets[tokens, None], temperature, vocab_start, group, kernels
                )
            logp[tokens], top_ids[tokens], top_logp[tokens] = picked[:, 0], ids, values - lse[:, None]
    return logp, top_ids, top_logp


def _gathered_top_k(
    z: Tensor, k: int, vocab_start: int, group: dist.ProcessGroup | None, num_ids: int
) -> tuple[Tensor, Tensor]:
    """The top-k logits [c, k] among ids < num_ids and their global ids [c, k] of a vocab-sliced chunk z [c, Vl]
    (see head_top_k)."""
    if vocab_start + z.shape[-1] > num_ids:  # ids past the student's vocabulary are never chosen
        z = z.clone()
        z[:, max(num_ids - vocab_start, 0) :] = -torch.inf
    values, ids = z.topk(min(k, z.shape[-1]), dim=-1)  # [c, kl] each
    ids = ids + vocab_start
    if group is None or dist.get_world_size(group) == 1:
        return values, ids
    tp = dist.get_world_size(group)
    all_values = [torch.empty_like(values) for _ in range(tp)]
    all_ids = [torch.empty_like(ids) for _ in range(tp)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_ids, ids.contiguous(), group=group)
    candidates, candidate_ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)  # [c, tp kl]
    best, where = candidates.topk(k, dim=-1)  # [c, k]
    return best, candidate_ids.gather(-1, where)


def _check_args(hidden: Tensor, targets: Tensor, temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )


def _scored_stats(
    hidden, weight, ids, temperature, vocab_start, group, chunk, kernels
) -> tuple[Tensor, Tensor]:
    """(log-probs [N, m] of `ids` [N, m], entropies [N]) through the fused head (see the module docstring)."""
    return _HeadTokenStats.apply(
        hidden,
        weight,
        ids.long(),
        temperature,
        vocab_start,
        group,
        chunk or chunk_tokens(weight.shape[0]),
        _compute_dtype(hidden, weight),
        kernels,
    )


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) would compute in here (autocast's when it is on)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _HeadTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_start, group, chunk, compute, kernels):
        ctx.set_materialize_grads(False)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute), weight.to(compute)
            logp = torch.empty(targets.shape, device=h.device)  # [N, m] fp32
            lse, mean_z = (torch.empty(h.shape[0], device=h.device) for _ in range(2))  # [N] fp32 each
            for start in range(0, h.shape[0], chunk):
                tokens = slice(start, start + chunk)
                if kernels is None:
                    z = _chunk_logits(h[tokens], w, temperature)  # [c, Vl]
                    stats = _logit_stats(z, targets[tokens], vocab_start, group)
                else:
                    stats = _native_stats(
                        h[tokens] @ w.T, targets[tokens], temperature, vocab_start, group, kernels
                    )
                logp[tokens], lse[tokens], mean_z[tokens] = stats
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.args = (temperature, vocab_start, chunk, compute, kernels)
        return logp, lse - mean_z

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        temperature, vocab_start, chunk, compute, kernels = ctx.args
        grad_hidden = grad_weight = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute), weight.to(compute)
            if ctx.needs_input_grad[0]:
                grad_hidden = torch.empty_like(h)
            if ctx.needs_input_grad[1]:  # summed over chunks in fp32
                grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for start in range(0, h.shape[0], chunk):
                tokens = slice(start, start + chunk)
                chunk_grads = (
                    lse[tokens],
                    mean_z[tokens],
                    temperature,
                    vocab_start,
                    None if grad_logp is None else grad_logp[tokens],
                    None if grad_entropy is None else grad_entropy[tokens],
                )
                if kernels is None:
                    dz = _chunk_grad(h[tokens], w, targets[tokens], *chunk_grads).to(compute)
                else:
                    dz = _native_grad(h[tokens] @ w.T, targets[tokens], *chunk_grads, kernels)
                if grad_hidden is not None:
                    grad_hidden[tokens] = dz @ w
                if grad_weight is not None:
                    if compute == torch.float32:
                        grad_weight.addmm_(dz.T, h[tokens])
                    elif kernels is not None:  # one pass, no fp32 copy of the product
                        kernels.accumulate_(grad_weight, dz.T @ h[tokens])
                    else:
                        grad_weight += dz.T @ h[tokens]
                del dz  # before the next chunk's buffers exist
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _chunk_logits(h: Tensor, w: Tensor, temperature: float) -> Tensor:
    """fp32 logits / temperature of one chunk [c, Vl] (a fresh buffer, safe to modify in place)."""
    z = (h @ w.T).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _local_targets(targets: Tensor, vocab_start: int, local_vocab: int) -> tuple[Tensor, Tensor]:
    """Targets as indices into this rank's slice (clamped) and whether each falls in it."""
    local = targets - vocab_start
    inside = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), inside


def _logit_stats(z, targets, vocab_start, group) -> tuple[Tensor, Tensor, Tensor]:
    """(logp [c, m] of targets [c, m], lse [c], sum p z [c]) of one chunk's logits z [c, Vl], all-reduced over
    `group`; z is overwritten."""
    peak = z.max(-1).values  # [c]
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    local, inside = _local_targets(targets, vocab_start, z.shape[-1])
    picked = z.gather(-1, local) * inside  # [c, m]
    z.sub_(peak[:, None])  # z - m
    e = z.exp()  # [c, Vl]
    sum_exp = e.sum(-1)
    weighted = e.mul_(z).sum(-1)  # sum e^(z-m) (z-m)
    return _reduced_stats(peak, sum_exp, weighted, picked, group)


def _reduced_stats(peak, sum_exp, weighted, picked, group) -> tuple[Tensor, Tensor, Tensor]:
    """(logp [c, m], lse [c], sum p z [c]) from a chunk's shift `peak` (already all-reduced) and its sums
    over this rank's slice (all-reduced here): sum e^(z-m), sum e^(z-m) (z-m), the picked logits [c, m]."""
    sums = torch.cat([sum_exp[:, None], weighted[:, None], picked], dim=-1)  # [c, 2 + m]
    if group is not None:
        dist.all_reduce(sums, group=group)
    sum_exp, weighted, picked = sums[:, 0], sums[:, 1], sums[:, 2:]
    lse = peak + sum_exp.log()
    mean_z = weighted / sum_exp + peak  # sum p z
    return picked - lse[:, None], lse, mean_z


def _native_stats(z, targets, temperature, vocab_start, group, kernels) -> tuple[Tensor, Tensor, Tensor]:
    """`_logit_stats` of a chunk's matmul output z [c, Vl] (not yet divided by the temperature) by `kernels`."""
    peak = kernels.peak(z, temperature)  # [c]
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    local, inside = _local_targets(targets, vocab_start, z.shape[-1])
    picked = z.gather(-1, local).float()  # [c, m]
    if temperature != 1.0:
        picked = picked.div_(temperature)
    sum_exp, weighted = kernels.sums(z, temperature, peak)
    return _reduced_stats(peak, sum_exp, weighted, picked * inside, group)


def _native_grad(
    z, targets, lse, mean_z, temperature, vocab_start, grad_logp, grad_entropy, kernels
) -> Tensor:
    """`_chunk_grad` of a chunk's matmul output z [c, Vl] by `kernels`, in z's dtype (over z)."""
    local, inside = _local_targets(targets, vocab_start, z.shape[-1])
    ids = torch.where(inside, local, -1)
    return kernels.grad_(z, temperature, lse, mean_z, grad_entropy, grad_logp, ids)


def _chunk_grad(h, w, targets, lse, mean_z, temperature, vocab_start, grad_logp, grad_entropy) -> Tensor:
    """d loss / d(h @ w.T) [c, Vl] fp32 of one chunk: (sum_j g_j (onehot(id_j) - p) - g_H p (z - sum p z)) / T,
    with targets and grad_logp [c, m] (j over a position's m scored ids)."""
    z = _chunk_logits(h, w, temperature)  # [c, Vl]
    p = (z - lse[:, None]).exp_()  # [c, Vl]
    coef = z  # -dz / p, built in z's buffer: g_logp + g_H (z - sum p z)
    if grad_entropy is not None:
        coef.sub_(mean_z[:, None]).mul_(grad_entropy[:, None])
    else:
        coef.zero_()
    if grad_logp is not None:
        coef.add_(grad_logp.sum(-1)[:, None])
    dz = p.mul_(coef).neg_()
    del z, coef
    if grad_logp is not None:
        local, inside = _local_targets(targets, vocab_start, dz.shape[-1])
        dz.scatter_add_(-1, local, grad_logp * inside)
    return dz.div_(temperature) if temperature != 1.0 else dz
