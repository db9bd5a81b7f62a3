"""Training's log-probs from hidden states and the LM head in chunks (dockrl.algos.head_logprobs): values and
gradients against float64, and the memory of the pass at Qwen2.5's vocabulary.

Tolerances are per element, from a first-order rounding analysis of what the fused path computes (u: the unit
roundoff of fp32, 2^-24; u_b: that of bf16, 2^-8; A = |h| |W|.T / T, the logits computed on absolute values):

  logit z_ij              (H + 1) u A_ij against float64 logits (H products summed, one division by T)  = e_ij
                          (bf16: the reference takes the bf16 matmul's own logits, so e_ij = u |z_ij|)
  lse_i, m_i = sum p z    the logits' errors weighted by d lse/dz = p and d m/dz = p (1 + |z - m|), plus
                          the roundings of the exp, the sums of V terms and the log: (V + 8 + S + |lse|) u
                          for lse, (2V + 8) u (S + Q) + u |m| for m (S = sum p |z - peak|, Q = sum p (z - peak)^2)
  p_ij = exp(z - lse)     relative: e_ij + err(lse_i) + u |z - lse| + u
  dz = (g_logp (onehot - p) - g_H p (z - m)) / T
                          p (relative err(p) + 4u) (|g_logp| + |g_H| |z - m|) + p |g_H| (e_ij + err(m_i)), over T,
                          + 2u |dz|; in bf16 dz is cast to bf16 before its matmuls: + u_b |dz|
  grad_h = dz @ W         err(dz) @ |W| + ((V + 1) u + u_b) (|dz| @ |W|)   (the same backward on |values|;
                          u_b only in bf16, where the matmuls' outputs are bf16)
  grad_W = sum dz.T @ h   err(dz).T @ |h| + ((N + 1) u + u_b) (|dz|.T @ |h|), the chunks summed in fp32

with |dz| bounded by D = (|g_logp| (onehot + p) + |g_H| p |z - m|) / T. A backward with a wrong sign or a missing
factor is off by O(1) of D; the tests run the check once against such broken backwards and require it to fail.

The native kernels (models/native/head.c, `kernels=`) compute each element as torch's ops do, the sums in
another order and the exponential with glibc's vector expf instead of torch's: both within the bounds above
(one rounding u per exp, V u per sum of V terms in any order), so the same bounds hold for both paths.
"""

from __future__ import annotations

import pytest
import torch

import dockrl.algos.head_logprobs as head_logprobs
from dockrl.algos.head_logprobs import head_token_stats
from dockrl.models.native.head import HeadKernels, head_kernels

NATIVE = head_kernels()
# torch's ops, and the native kernels where they build here
PATHS = [
    "torch",
    pytest.param(
        "native", marks=pytest.mark.skipif(NATIVE is None, reason="the native kernels do not build here")
    ),
]

U32 = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-8  # bf16 unit roundoff


def _inputs(tokens=509, hidden=64, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)  # [N, H]
    w = torch.randn(vocab, hidden, generator=g) * 0.3  # [V, H]: logits of a few units, as in a trained head
    return h, w, torch.randint(0, vocab, (tokens,), generator=g), torch.randn(2, tokens, generator=g)


def _reference_and_bounds(z, h, w, targets, temperature, g_logp, g_entropy, logit_error, u_out):
    """float64 (values, bounds) of log-probs [N], entropies [N], grad h [N, H] and grad W [V, H] from logits z
    [N, V] (already / T) with per-logit errors `logit_error` [N, V]; `u_out`: the rounding of dz and of the
    matmuls' outputs (0 when they stay fp32). See the module docstring."""
    h, w, g_logp, g_entropy = h.double(), w.double(), g_logp.double()[:, None], g_entropy.double()[:, None]
    num_tokens, vocab = z.shape
    onehot = torch.nn.functional.one_hot(targets, vocab).double()  # [N, V]
    lse = torch.logsumexp(z, -1, keepdim=True)  # [N, 1]
    p = (z - lse).exp()  # [N, V]
    m = (p * z).sum(-1, keepdim=True)  # [N, 1]
    logp, entropy = (z - lse).gather(-1, targets[:, None]), lse - m
    from_peak = (z - z.max(-1, keepdim=True).values).abs()
    s, q = (p * from_peak).sum(-1, keepdim=True), (p * from_peak**2).sum(-1, keepdim=True)
    err_lse = (p * logit_error).sum(-1, keepdim=True) + (vocab + 8 + s) * U32 + U32 * lse.abs()
    err_m = (p * (1 + (z - m).abs()) * logit_error).sum(-1, keepdim=True)
    err_m = err_m + (2 * vocab + 8) * U32 * (s + q) + U32 * m.abs()
    err_p = logit_error + err_lse + U32 * ((z - lse).abs() + 1)  # relative, [N, V]
    coef = g_logp.abs() + g_entropy.abs() * (z - m).abs()  # bounds |g_logp + g_H (z - m)|
    dz = (g_logp * (onehot - p) - g_entropy * p * (z - m)) / temperature
    dz_mag = (g_logp.abs() * (onehot + p) + g_entropy.abs() * p * (z - m).abs()) / temperature  # D
    err_dz = p * ((err_p + 4 * U32) * coef + g_entropy.abs() * (logit_error + err_m)) / temperature
    err_dz = err_dz + (2 * U32 + u_out) * dz_mag
    values = {"logp": logp.squeeze(-1), "entropy": entropy.squeeze(-1), "grad_h": dz @ w, "grad_w": dz.T @ h}
    bounds = {
        "logp": (logit_error.gather(-1, targets[:, None]) + err_lse + U32 * logp.abs()).squeeze(-1),
        "entropy": (err_lse + err_m + U32 * entropy.abs()).squeeze(-1),
        "grad_h": err_dz @ w.abs() + ((vocab + 1) * U32 + u_out) * (dz_mag @ w.abs()),
        "grad_w": err_dz.T @ h.abs() + ((num_tokens + 1) * U32 + u_out) * (dz_mag.T @ h.abs()),
    }
    return values, bounds


def _worst(actual, values, bounds):
    """The largest error / bound over each quantity's elements (<= 1: within its rounding)."""
    return {k: ((actual[k].double() - values[k]).abs() / bounds[k]).max().item() for k in values}


def _no_inverse_temperature(h, w, targets, lse, mean_z, temperature, *args):
    """A broken backward: dz without its 1/T factor."""
    return _CHUNK_GRAD(h, w, targets, lse, mean_z, temperature, *args) * temperature


def _flipped_entropy_sign(h, w, targets, lse, mean_z, temperature, vocab_start, grad_logp, grad_entropy):
    """A broken backward: the entropy's gradient with the wrong sign."""
    flipped = None if grad_entropy is None else -grad_entropy
    return _CHUNK_GRAD(h, w, targets, lse, mean_z, temperature, vocab_start, grad_logp, flipped)


_CHUNK_GRAD = head_logprobs._chunk_grad


class _NativeWithoutInverseTemperature(HeadKernels):
    """Broken native kernels: dz without its 1/T factor."""

    def grad_(self, z, temperature, *args):
        return super().grad_(z, temperature, *args).mul_(temperature)


class _NativeWithFlippedEntropySign(HeadKernels):
    """Broken native kernels: the entropy's gradient with the wrong sign."""

    def grad_(self, z, temperature, lse, mean_z, grad_entropy, *args):
        flipped = None if grad_entropy is None else -grad_entropy
        return super().grad_(z, temperature, lse, mean_z, flipped, *args)


def _fused(h, w, targets, temperature, coef, terms, chunk, autocast=False, kernels=None):
    """Run the fused pass and its backward on copies of h, w: {logp, entropy, grad_h, grad_w}."""
    fused_h, fused_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp, entropy = head_token_stats(fused_h, fused_w, targets, temperature, chunk=chunk, kernels=kernels)
    loss = (logp * coef[0]).sum() * (terms != "entropy") + (entropy * coef[1]).sum() * (terms != "logp")
    loss.backward()
    return {"logp": logp, "entropy": entropy, "grad_h": fused_h.grad, "grad_w": fused_w.grad}


def _loss_coefficients(coef, terms):
    """(g_logp, g_H) [N] each: d loss / d logp and d loss / d entropy of the tests' losses."""
    return coef[0] * (terms != "entropy"), coef[1] * (terms != "logp")


def _run_broken(path, terms, monkeypatch, run):
    """`run(kernels)`'s error ratios, by name, with each broken backward of `path` in place: torch's
    `_chunk_grad` patched, or broken native kernels passed in (the entropy's only where the loss has it)."""
    with_entropy = terms != "logp"
    if path == "native":
        assert NATIVE is not None
        kinds = [_NativeWithoutInverseTemperature] + ([_NativeWithFlippedEntropySign] if with_entropy else [])
        for kind in kinds:
            yield kind.__name__, run(kind(NATIVE._kernels))
        return
    for chunk_grad in [_no_inverse_temperature] + ([_flipped_entropy_sign] if with_entropy else []):
        with monkeypatch.context() as patch:
            patch.setattr(head_logprobs, "_chunk_grad", chunk_grad)
            yield chunk_grad.__name__, run(None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("terms", ["both", "logp", "entropy"])
def test_values_and_gradients_match_float64_logits(terms, path, monkeypatch):
    """509 tokens in chunks of 100 (the last one ragged), temperature 0.7; the loss weighs log-probs and/or
    entropies by random coefficients, so every gradient path is checked, each element within its own bound.
    `path`: torch's ops or the native kernels (the same bounds: the module docstring)."""
    h, w, targets, coef = _inputs()
    temperature = 0.7
    z = (h.double() @ w.double().T) / temperature  # [N, V]
    logit_error = (h.shape[1] + 1) * U32 * (h.double().abs() @ w.double().abs().T) / temperature
    values, bounds = _reference_and_bounds(
        z, h, w, targets, temperature, *_loss_coefficients(coef, terms), logit_error, 0.0
    )

    def worst(kernels):
        out = _fused(h, w, targets, temperature, coef, terms, chunk=100, kernels=kernels)
        return _worst(out, values, bounds)

    assert max(worst(NATIVE if path == "native" else None).values()) <= 1
    assert (
        values["grad_h"].abs().max() > 0.1 and values["grad_w"].abs().max() > 0.1
    )  # the bounds are not vacuous
    for name, ratios in _run_broken(path, terms, monkeypatch, worst):  # the check fails on a wrong backward
        assert ratios["grad_h"] > 1 and ratios["grad_w"] > 1, (name, ratios)


@pytest.mark.parametrize("path", PATHS)
def test_bf16_autocast_computes_the_head_in_bf16(path, monkeypatch):
    """Under bf16 autocast the matmuls run in bf16 as F.linear would, the statistics in fp32; gradients come back
    in the inputs' dtype (fp32 master weights). The reference is float64 on the logits the bf16 matmul gives
    (the same call on the same chunk as the fused path: the same bits), so a logit carries only the fp32
    division by T; dz is rounded to bf16 before its matmuls and their outputs are bf16 (u_b each)."""
    h, w, targets, coef = _inputs(tokens=64, vocab=300)
    temperature, chunk = 0.7, 16
    hb, wb = h.bfloat16(), w.bfloat16()
    z = torch.cat([hb[i : i + chunk] @ wb.T for i in range(0, len(hb), chunk)]).double() / temperature
    g_logp, g_entropy = _loss_coefficients(coef, "both")
    values, bounds = _reference_and_bounds(
        z, hb, wb, targets, temperature, g_logp, g_entropy, U32 * z.abs(), U16
    )

    def fused(kernels):
        return _fused(h, w, targets, temperature, coef, "both", chunk=chunk, autocast=True, kernels=kernels)

    out = fused(NATIVE if path == "native" else None)
    assert out["logp"].dtype == torch.float32 and out["grad_w"].dtype == torch.float32
    assert max(_worst(out, values, bounds).values()) <= 1
    assert values["grad_h"].abs().max() > 0.1 and values["grad_w"].abs().max() > 0.1

    def ratios(kernels):
        return _worst(fused(kernels), values, bounds)

    for name, broken in _run_broken(path, "both", monkeypatch, ratios):  # the check fails on a wrong backward
        assert broken["grad_h"] > 1 and broken["grad_w"] > 1, (name, broken)


def test_token_stats_score_only_response_positions(tiny_model):
    """TrainEngine.token_stats sends only each row's response positions through the LM head: there its
    log-probs and entropies are log_softmax of the full logits (up to the matmul's and the log-sum-exp's
    summation order: at most (H + 1) u |z| + (V + 8) u + u |lse| with H 64, V ~500, logits of a few units and
    lse ~6: about 4e-5, under 1e-4), 0
    on prompt and padding positions; and the parameters' gradients of a loss on them are those of the same
    loss on the full logits (each a sum of at most N + V fp32 products in another order: 1e-4 of the largest)."""
    from dockrl.config.schema import ActorConfig
    from dockrl.engines.train.batch import make_micro_batch
    from dockrl.engines.train.train_engine import TrainEngine

    engine = TrainEngine(str(tiny_model), device="cpu", precision="fp32", optim=ActorConfig(lr=1e-3))
    g = torch.Generator().manual_seed(0)
    lengths = [(5, 9), (11, 3), (2, 14)]  # (prompt, response): rows of different shapes, right padding
    prompts = [torch.randint(3, 400, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(3, 400, (r,), generator=g) for _, r in lengths]
    mb = make_micro_batch(prompts, responses, pad_token_id=0)
    weights = torch.randn(mb.response_mask.shape, generator=g)

    def grads(loss):
        engine.model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in engine.model.named_parameters()}

    logp, entropy = engine.token_stats(mb, 1.0)
    fused = grads((logp * weights * mb.response_mask).sum() + (entropy * mb.response_mask).sum())
    logits = engine.logits(mb).float()
    full = torch.log_softmax(logits, -1)
    full_logp = full.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    full_entropy = -(full.exp() * full).sum(-1)
    plain = grads((full_logp * weights * mb.response_mask).sum() + (full_entropy * mb.response_mask).sum())
    mask = mb.response_mask.bool()
    assert int(mask.sum()) == sum(r for _, r in lengths)
    assert torch.allclose(logp[mask], full_logp[mask].detach(), rtol=0, atol=1e-4)
    assert torch.allclose(entropy[mask], full_entropy[mask].detach(), rtol=0, atol=1e-4)
    assert torch.equal(logp[~mask], torch.zeros_like(logp[~mask]))
    assert torch.equal(entropy[~mask], torch.zeros_like(entropy[~mask]))
    for name, grad in plain.items():
        scale = float(grad.abs().max())
        assert torch.allclose(fused[name], grad, rtol=0, atol=1e-4 * scale + 1e-12), name


@pytest.mark.skipif(NATIVE is None, reason="the native kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_chunk_grad_scatters_repeated_and_foreign_ids(dtype):
    """The native dz of one chunk against `_chunk_grad` on the same logits, with m = 4 scored ids per position
    (top-k distillation's target and support): ids repeated within a row (their gradients summed, as
    scatter_add does) and ids outside this rank's slice (vocab_start 100: skipped). Broken on purpose: a
    repeated id scattered once, and the foreign ids taken as local ones.

    Per element the two compute the same fp32 expression in the same order, but for the exponential (an ulp or
    two each: 4u relative on p) and the divisions by T, which the kernel takes as products with the rounded
    1 / T (within 2u relative of torch's quotient). So x = z / T may differ by dx = 2u |x|, and each rounded
    op after it may then round the other way (2u of its result):
      x - mean_z            dx + 2u |x - m|                     = d_xm
      (x - m) g_H + g_sum   |g_H| d_xm + 2u |(x - m) g_H| + 2u |coef|           = d_coef
      p = e^(x - lse)       p (dx + 2u |x - lse| + 4u)                          = d_p
      p coef / T            (d_p |coef| + p d_coef + 2u |p coef|) / T + (2u + 2 u_out) |dz| (the final
                            product with 1 / T, a scored id's added gradients, the rounding to the output dtype)
    plus the smallest normal."""
    g = torch.Generator().manual_seed(3)
    rows, hidden, vocab, temperature, vocab_start = 37, 16, 300, 0.7, 100
    h = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
    ids = torch.randint(vocab_start, vocab_start + vocab, (rows, 4), generator=g)
    ids[:, 2] = ids[:, 0]  # a repeated id in every row
    ids[::3, 3] = vocab_start + vocab + 5  # another rank's id
    ids[1::5, 1] = 7
    grad_logp, grad_entropy = torch.randn(rows, 4, generator=g), torch.randn(rows, generator=g)
    logp, lse, mean_z = head_logprobs._logit_stats(
        head_logprobs._chunk_logits(h, w, temperature), ids, vocab_start, None
    )
    expected = head_logprobs._chunk_grad(
        h, w, ids, lse, mean_z, temperature, vocab_start, grad_logp, grad_entropy
    )
    z = h @ w.T
    x = z.float() / temperature
    p = (x - lse[:, None]).exp()
    coef = grad_logp.sum(-1, keepdim=True) + (x - mean_z[:, None]) * grad_entropy[:, None]
    u_out = U32 if dtype == torch.float32 else U16

    def error(native_grad):
        got = native_grad(z.clone(), ids, lse, mean_z, temperature, vocab_start, grad_logp, grad_entropy)
        assert got.dtype == dtype
        dx = 2 * U32 * x.abs()
        d_xm = dx + 2 * U32 * (x - mean_z[:, None]).abs()
        g_h = grad_entropy.abs()[:, None]
        d_coef = g_h * d_xm + 2 * U32 * ((x - mean_z[:, None]).abs() * g_h + coef.abs())
        d_p = p * (dx + 2 * U32 * (x - lse[:, None]).abs() + 4 * U32)
        d_pc = d_p * coef.abs() + p * d_coef + 2 * U32 * (p * coef).abs()
        bound = d_pc / temperature + (2 * U32 + 2 * u_out) * expected.abs() + 2.0**-126
        return float(((got.float() - expected.to(dtype).float()).abs() / bound).max())

    def native(z, *args):
        return head_logprobs._native_grad(z, *args, NATIVE)

    assert error(native) <= 1
    assert expected.abs().max() > 0.1

    def scattered_once(z, ids, *args):  # a repeated id's second gradient dropped
        grads = args[4].clone()
        grads[:, 2] = 0
        return head_logprobs._native_grad(z, ids, *args[:4], grads, args[5], NATIVE)

    def foreign_taken(
        z, ids, lse, mean_z, temperature, vocab_start, *rest
    ):  # no slice: other ranks' ids kept
        return NATIVE.grad_(
            z, temperature, lse, mean_z, rest[1], rest[0], (ids - vocab_start).clamp(0, vocab - 1)
        )

    assert error(scattered_once) > 1 and error(foreign_taken) > 1
