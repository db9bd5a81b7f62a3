"""Per-token log-probabilities and entropies from logits, computed without a full fp32 copy.

Shape letters: B rows (sequences), T tokens per row, V vocabulary size.

Both functions walk the logits in chunks of tokens and upcast one chunk at a time to fp32, so the peak
extra memory of the forward pass is one fp32 chunk rather than a [B, T, V] fp32 tensor (the usual
cost of ``log_softmax(logits.float())`` on bf16 logits). The log-probability path uses
``logit[target] - logsumexp(logits)`` so no log-softmax over the vocabulary is materialised at all.
With autograd on, backward still keeps what each chunk needs; the saving is in the forward peak.

These serve code that has logits anyway (the sampler, SFT, evaluation). Training's log-probs come from the
hidden states and the LM head without any logits (`dockrl.algos.head_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Upper bound on elements per fp32 chunk (64 Mi elements = 256 MiB). Large enough that small and mid-size
# batches take a single chunk; small enough that a 150k vocabulary chunk stays far below the logits.
_CHUNK_ELEMENTS = 1 << 26


def _as_btv(logits: Tensor) -> Tensor:
    """View [T, V] (one packed sequence) as [1, T, V]; pass [B, T, V] through."""
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V] or [T, V]; got shape {tuple(logits.shape)}")
    return logits


def _map_token_chunks(logits: Tensor, fn: Callable[[Tensor, slice, int], Tensor]) -> Tensor:
    """Apply ``fn(chunk [t, V] fp32, token slice, row)`` over token chunks of each row; return [B, T] fp32."""
    num_rows, num_tokens, vocab = logits.shape
    chunk = max(1, min(num_tokens, _CHUNK_ELEMENTS // max(vocab, 1)))
    rows = []
    for row in range(num_rows):
        # Slicing one row and a token range keeps a view; only .float() copies, one chunk at a time.
        parts = [
            fn(logits[row, start : start + chunk].float(), slice(start, start + chunk), row)
            for start in range(0, num_tokens, chunk)
        ]
        rows.append(torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32))
    return torch.stack(rows)  # [B, T]


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    Args:
        logits: [B, T, V] (or [T, V]) in any float dtype; position t scores ``targets[:, t]``.
        targets: [B, T] (or [T]) integer token ids.
        temperature: softmax temperature; must match the sampler's for log-probs to agree with rollout.

    Returns:
        [B, T] (or [T]) fp32 log-probabilities, differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    squeeze = logits.dim() == 2
    logits_btv = _as_btv(logits)
    targets_bt = targets.unsqueeze(0) if squeeze else targets
    if targets_bt.shape != logits_btv.shape[:2]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match logits shape {tuple(logits.shape)} "
            "without the vocab dim"
        )
    targets_bt = targets_bt.long()

    def chunk_logprobs(chunk: Tensor, tokens: slice, row: int) -> Tensor:
        scaled = chunk / temperature if temperature != 1.0 else chunk  # [t, V]
        picked = scaled.gather(-1, targets_bt[row, tokens].unsqueeze(-1)).squeeze(-1)  # [t]
        return picked - torch.logsumexp(scaled, dim=-1)  # [t]

    out = _map_token_chunks(logits_btv, chunk_logprobs)  # [B, T]
    return out.squeeze(0) if squeeze else out


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)`` per chunk of tokens, in fp32.

    Args:
        logits: [B, T, V] (or [T, V]) in any float dtype.
        temperature: softmax temperature.

    Returns:
        [B, T] (or [T]) fp32 entropies in nats, differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    squeeze = logits.dim() == 2

    def chunk_entropy(chunk: Tensor, tokens: slice, row: int) -> Tensor:
        scaled = chunk / temperature if temperature != 1.0 else chunk  # [t, V]
        probs = torch.softmax(scaled, dim=-1)  # [t, V]
        return torch.logsumexp(scaled, dim=-1) - (probs * scaled).sum(-1)  # [t]

    out = _map_token_chunks(_as_btv(logits), chunk_entropy)  # [B, T]
    return out.squeeze(0) if squeeze else out
