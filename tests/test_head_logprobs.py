"""Training's log-probs from hidden states and the LM head in chunks (dockrl.algos.head_logprobs): values and
gradients against float64 logits, and the memory of the pass at Qwen2.5's vocabulary.

Tolerances: the fused path computes the same fp32 quantities as the naive one in another order. A logit is a sum
of H products, so its fp32 rounding is at most about H * eps * sum_k |h_k w_k| (eps = 2^-23); the log-sum-exp
and the gradients are built from those logits with O(1) more roundings each. The bounds below are that
worst case, times 4 for the steps after the matmul.
"""

from __future__ import annotations

import pytest
import torch

from dockrl.algos.head_logprobs import head_token_stats
from dockrl.bench.logprob_memory import measure

EPS32 = torch.finfo(torch.float32).eps


def _reference(hidden, weight, targets, temperature):
    """float64 log-probs and entropies [N] from whole logits."""
    z = (hidden.double() @ weight.double().T) / temperature  # [N, V]
    logp_all = torch.log_softmax(z, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _inputs(tokens=509, hidden=64, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)  # [N, H]
    w = torch.randn(vocab, hidden, generator=g) * 0.3  # [V, H]: logits of a few units, as in a trained head
    return h, w, torch.randint(0, vocab, (tokens,), generator=g), torch.randn(2, tokens, generator=g)


@pytest.mark.parametrize("terms", ["both", "logp", "entropy"])
def test_values_and_gradients_match_float64_logits(terms):
    """509 tokens in chunks of 100 (the last one ragged), temperature 0.7; the loss weighs log-probs and/or
    entropies by random coefficients, so every gradient path is checked."""
    h, w, targets, coef = _inputs()
    temperature = 0.7
    fused_h, fused_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, entropy = head_token_stats(fused_h, fused_w, targets, temperature, chunk=100)
    ref_h, ref_w = h.double().requires_grad_(True), w.double().requires_grad_(True)
    ref_logp, ref_entropy = _reference(ref_h, ref_w, targets, temperature)

    def loss(lp, en):
        return {"both": (lp * coef[0]).sum() + (en * coef[1]).sum(), "logp": (lp * coef[0]).sum()}.get(
            terms, (en * coef[1]).sum()
        )

    loss(logp, entropy).backward()
    loss(ref_logp, ref_entropy).backward()
    logit_error = h.shape[1] * EPS32 * ((h.abs() @ w.abs().T).max() / temperature)  # worst case of one logit
    assert (logp.double() - ref_logp).abs().max() <= 4 * logit_error
    assert (entropy.double() - ref_entropy).abs().max() <= 4 * logit_error * ref_entropy.abs().max()
    # d/dh = dz @ W / T and d/dW = dz.T @ h / T with |dz| <= 1 + |coef| (1 + |z|): bound each sum's rounding.
    dz_bound = (1 + coef.abs().max()) * (1 + (h.abs() @ w.abs().T).max() / temperature)
    grad_h_bound = 4 * (logit_error * dz_bound) * w.abs().sum(0).max() / temperature
    grad_w_bound = 4 * (logit_error * dz_bound) * h.abs().sum(0).max() / temperature
    assert (fused_h.grad.double() - ref_h.grad).abs().max() <= grad_h_bound
    assert (fused_w.grad.double() - ref_w.grad).abs().max() <= grad_w_bound
    assert fused_h.grad.abs().max() > 0.01 and fused_w.grad.abs().max() > 0.01  # the bounds are not vacuous


def test_bf16_autocast_computes_the_head_in_bf16():
    """Under bf16 autocast the matmuls run in bf16 as F.linear would, the statistics in fp32; gradients come back
    in the inputs' dtype (fp32 master weights). bf16 logits carry a relative rounding of 2^-8 each."""
    h, w, targets, coef = _inputs(tokens=64, vocab=300)
    fused_h, fused_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = head_token_stats(fused_h, fused_w, targets, 1.0, chunk=16)
    ((logp * coef[0]).sum() + (entropy * coef[1]).sum()).backward()
    assert logp.dtype == torch.float32 and fused_w.grad.dtype == torch.float32
    bf16_logits = (h.bfloat16() @ w.bfloat16().T).double()  # what the matmul gives, rounded to bf16
    ref_logp = torch.log_softmax(bf16_logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    # Summation order inside the bf16 matmul may differ by one bf16 rounding per logit.
    bound = 2 * torch.finfo(torch.bfloat16).eps * bf16_logits.abs().max()
    assert (logp.double() - ref_logp).abs().max() <= bound


def test_log_probs_at_qwen_vocabulary_stay_under_a_gigabyte():
    """Qwen2.5's head (V = 151,936, H = 896): one forward and backward pass of 512 tokens holds under 1 GiB above
    its inputs and the weight's gradient (the chunks' buffers only; whole fp32 logits with their gradient
    would be 2 x 297 MiB at this size and 2 x 4.7 GiB at 8k tokens). `dockrl bench logprobs` measures 8k."""
    row = measure("fused", tokens=512, vocab=151936, hidden=896)
    assert row["peak_mb"] < 1024, row
