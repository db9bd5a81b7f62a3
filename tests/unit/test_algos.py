"""algos/: log-probs, advantages, KL estimators, clipped surrogate and aggregation against hand-computed numbers.

Expected values are written out as literals (worked by hand or with a calculator in the comments), not
re-derived with the code under test.
"""

import math

import pytest
import torch

from dockrl.algos import (
    aggregate,
    group_normalized_advantages,
    kl_penalty,
    policy_loss,
    token_entropy,
    token_logprobs,
)
from dockrl.algos import logprobs as logprobs_module
from helpers import close

# ---------------------------------------------------------------- log-probs and entropy


def test_token_logprobs_matches_softmax_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])  # [1, 2, 3]
    targets = torch.tensor([[2, 0]])
    # 3 - log(e + e^2 + e^3) = 3 - log(30.19287) ; uniform over 3 -> -log 3
    close(token_logprobs(logits, targets), [[-0.4076060, -1.0986123]])
    # temperature 2: z = [0.5, 1, 1.5]; 1.5 - log(e^.5 + e + e^1.5) = 1.5 - log(8.84869)
    close(token_logprobs(logits, targets, temperature=2.0), [[-0.6802697, -1.0986123]])
    # [T, V] input (one packed sequence) gives [T]
    close(token_logprobs(logits[0], targets[0]), [-0.4076060, -1.0986123])


def test_token_entropy_matches_softmax_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    # p = [0.0900, 0.2447, 0.6652]; H = -sum p log p = 0.8323956 ; uniform over 3 -> log 3
    close(token_entropy(logits), [[0.8323956, 1.0986123]])
    close(token_entropy(logits, temperature=2.0), [[1.0201913, 1.0986123]])


def test_logprobs_bf16_are_fp32_and_match_upcast_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11).to(torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5))
    out = token_logprobs(logits, targets, temperature=0.7)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref)
    assert token_entropy(logits).dtype == torch.float32


def test_chunked_path_matches_full_softmax_values_and_grads(monkeypatch):
    # Force 3 tokens per chunk so rows of 7 tokens take 3 chunks (3 + 3 + 1).
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 3 * 13)
    torch.manual_seed(1)
    logits = torch.randn(2, 7, 13, requires_grad=True)
    targets = torch.randint(0, 13, (2, 7))
    lp = token_logprobs(logits, targets)
    ent = token_entropy(logits)
    (lp.sum() + ent.sum()).backward()
    chunked_grad = logits.grad.clone()

    logits.grad = None
    log_p = torch.log_softmax(logits, -1)
    lp_ref = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent_ref = -(log_p.exp() * log_p).sum(-1)
    (lp_ref.sum() + ent_ref.sum()).backward()
    torch.testing.assert_close(lp, lp_ref)
    torch.testing.assert_close(ent, ent_ref)
    torch.testing.assert_close(chunked_grad, logits.grad)


def test_logprobs_shape_errors():
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


# ---------------------------------------------------------------- advantages


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503 -> +-0.5 / 0.5773503 = +-0.8660254
    # group 1: all equal -> zeros
    close(
        group_normalized_advantages(rewards, 4),
        [0.8660254, -0.8660254, -0.8660254, 0.8660254, 0.0, 0.0, 0.0, 0.0],
    )
    close(
        group_normalized_advantages(rewards, 4, normalize_std=False),
        [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
    )
    # [0, 3]: mean 1.5, unbiased std sqrt(2 * 2.25 / 1) = 2.1213203 -> +-0.7071068
    close(group_normalized_advantages(torch.tensor([0.0, 3.0]), 2), [-0.7071068, 0.7071068])


def test_group_advantages_group_size_one_and_errors():
    close(group_normalized_advantages(torch.tensor([1.0, 0.0, 5.0]), 1), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_normalized_advantages(torch.zeros(6), 4)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    # d = logp - ref = [0.5, -1, 0]
    close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0, 0.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5, 0.0]])
    # x = ref - logp = [-0.5, 1, 0]; e^x - x - 1 = [0.6065307 - 0.5, 2.7182818 - 2, 0]
    close(kl_penalty(logp, ref, "k3"), [[0.1065307, 0.7182818, 0.0]])


def test_k3_clamps_extreme_log_ratios_without_nan_grads():
    logp = torch.tensor([[0.0, -1000.0, -12.0]], requires_grad=True)
    ref = torch.tensor([[-1000.0, 0.0, 0.0]])
    kl = kl_penalty(logp, ref, "k3")
    # x = -1000 -> clamp -20 -> e^-20 + 19 = 19 -> clamp 10; x = 1000 -> clamp 20 -> huge -> 10;
    # x = 12 -> e^12 - 13 = 162741.8 -> 10
    close(kl, [[10.0, 10.0, 10.0]])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()  # exp(1000) unclamped would give inf * 0 = nan


def test_unknown_kl_estimator_names_choices():
    with pytest.raises(ValueError, match=r"'k9'.*k1.*k2.*k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k9")


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    close(aggregate(values, mask, "token-mean"), 7.0 / 3.0)  # (1 + 2 + 4) / 3
    close(aggregate(values, mask, "token-mean", num_tokens=7), 1.0)  # 7 / 7
    close(aggregate(values, mask, "seq-mean-token-mean"), 2.75)  # (1.5 + 4) / 2
    close(aggregate(values, mask, "seq-mean-token-sum"), 3.5)  # (3 + 4) / 2
    close(aggregate(values, mask, "seq-mean-token-sum", num_seqs=7), 1.0)  # (3 + 4) / 7
    close(aggregate(values, mask.float(), "token-mean"), 7.0 / 3.0)  # float mask works the same
    close(aggregate(values, torch.zeros_like(mask), "token-mean"), 0.0)  # nothing valid -> 0, not NaN
    close(aggregate(values, torch.zeros_like(mask), "seq-mean-token-mean"), 0.0)
    with pytest.raises(ValueError, match="'mean'"):
        aggregate(values, mask, "mean")


# ---------------------------------------------------------------- clipped surrogate


def _logp_for(ratios):
    """Current log-probs that give these ratios against old log-probs of 0."""
    return torch.tensor(ratios).log().requires_grad_(True)


def test_clipped_surrogate_inside_and_outside_range():
    # row 0 A=+1: r=1.1 inside -> -1.1 ; r=1.5 above 1.2 -> max(-1.5, -1.2) = -1.2 (clipped) ;
    #             r=0.5 below 0.8 -> max(-0.5, -0.8) = -0.5 (not clipped: no gain from going lower)
    # row 1 A=-1: r=1.5 -> max(1.5, 1.2) = 1.5 (not clipped) ; r=0.5 -> max(0.5, 0.8) = 0.8 (clipped) ;
    #             r=0.9 inside -> 0.9
    logp = _logp_for([[1.1, 1.5, 0.5], [1.5, 0.5, 0.9]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = policy_loss(logp, old, adv, mask)
    # (-1.1 - 1.2 - 0.5 + 1.5 + 0.8 + 0.9) / 6 = 0.4 / 6
    close(out.loss, 0.0666667)
    close(out.pg_loss, 0.0666667)
    close(out.clip_frac, 2.0 / 6.0)
    # approx_kl = mean(old - logp) = -(ln1.1 + 2 ln1.5 + 2 ln0.5 + ln0.9) / 6 = 0.5854145 / 6
    close(out.approx_kl, 0.0975691)
    close(out.kl, 0.0)
    out.loss.backward()
    # d/dlogp of -A*r is -A*r; clipped tokens get 0; each token weighs 1/6
    close(logp.grad, [[-1.1 / 6, 0.0, -0.5 / 6], [1.5 / 6, 0.0, 0.9 / 6]])
    # per-row advantages [B] broadcast to the same result
    close(policy_loss(logp.detach(), old, torch.tensor([1.0, -1.0]), mask).loss, 0.0666667)


def test_clip_low_and_high_apply_separately():
    # clip range [0.9, 1.3]
    # A=+1: r=1.25 inside -> -1.25 ; r=1.5 -> -1.3 (clipped)
    # A=-1: r=0.85 -> max(0.85, 0.9) = 0.9 (clipped) ; r=0.95 inside -> 0.95
    logp = _logp_for([[1.25, 1.5], [0.85, 0.95]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    out = policy_loss(logp, torch.zeros(2, 2), adv, torch.ones(2, 2), clip_low=0.1, clip_high=0.3)
    close(out.pg_loss, (-1.25 - 1.3 + 0.9 + 0.95) / 4)  # -0.175
    close(out.clip_frac, 0.5)
    # symmetric [0.8, 1.2] instead clips r=1.25 (-> -1.2) and no longer clips r=0.85
    out_sym = policy_loss(logp, torch.zeros(2, 2), adv, torch.ones(2, 2))
    close(out_sym.pg_loss, (-1.2 - 1.2 + 0.85 + 0.95) / 4)  # -0.15
    close(out_sym.clip_frac, 0.5)


def test_uneven_masks_in_each_aggregation_mode():
    # Same per-token losses as test_clipped_surrogate_inside_and_outside_range, row 1 only 1 token long;
    # its padding holds an extreme ratio that must not leak in.
    logp = _logp_for([[1.1, 1.5, 0.5], [1.5, 50.0, 1e-3]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # valid per-token losses: row 0 [-1.1, -1.2, -0.5], row 1 [1.5]
    close(policy_loss(logp, old, adv, mask, agg="token-mean").loss, -0.325)  # -1.3 / 4
    close(policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean").loss, 0.2833333)  # (-2.8/3 + 1.5) / 2
    close(policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum").loss, -0.65)  # (-2.8 + 1.5) / 2
    close(policy_loss(logp, old, adv, mask).clip_frac, 0.25)  # 1 clipped of 4 valid


def test_kl_and_entropy_terms_enter_the_loss():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    entropy = torch.tensor([[2.0, 4.0]])
    out = policy_loss(
        logp,
        logp.detach(),  # ratio 1
        torch.zeros(1, 2),  # no policy-gradient signal
        torch.ones(1, 2),
        ref_logprobs=ref,
        kl_coef=0.1,
        kl_estimator="k1",
        entropy=entropy,
        entropy_coef=0.01,
    )
    # kl = mean(0.5, -1.0) = -0.25 ; entropy = mean(2, 4) = 3 ; loss = 0.1 * -0.25 - 0.01 * 3
    close(out.kl, -0.25)
    close(out.entropy, 3.0)
    close(out.loss, -0.055)
    assert not out.kl.requires_grad and out.loss.requires_grad
    # kl is still reported when kl_coef is 0, but stays out of the loss
    out_no_coef = policy_loss(logp, logp.detach(), torch.zeros(1, 2), torch.ones(1, 2), ref_logprobs=ref)
    close(out_no_coef.kl, 0.1065307 / 2 + 0.7182818 / 2)  # k3 default, see test_kl_estimators_by_hand
    close(out_no_coef.loss, 0.0)


def test_policy_loss_argument_errors():
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(t, t, t, t, kl_coef=0.1)
    with pytest.raises(ValueError, match="needs per-token entropy"):
        policy_loss(t, t, t, t, entropy_coef=0.1)
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(t, t, t, torch.zeros(2, 2))


@pytest.mark.parametrize(
    "agg, count_kw",
    [("token-mean", "num_tokens"), ("seq-mean-token-mean", "num_seqs"), ("seq-mean-token-sum", "num_seqs")],
)
def test_two_micro_batches_with_global_count_equal_one_batch(agg, count_kw):
    torch.manual_seed(0)
    num_rows, num_tokens = 4, 6
    old = torch.randn(num_rows, num_tokens)
    base = (old + 0.3 * torch.randn(num_rows, num_tokens)).detach()
    ref = torch.randn(num_rows, num_tokens)
    adv = torch.randn(num_rows, num_tokens)
    lengths = torch.tensor([6, 2, 4, 1])  # uneven rows: micro-batch token counts differ (8 vs 5)
    mask = torch.arange(num_tokens)[None, :] < lengths[:, None]
    kwargs = dict(kl_coef=0.05, agg=agg)

    full = base.clone().requires_grad_(True)
    full_loss = policy_loss(full, old, adv, mask, ref_logprobs=ref, **kwargs).loss
    full_loss.backward()

    micro = base.clone().requires_grad_(True)
    count = {"num_tokens": float(mask.sum()), "num_seqs": float(num_rows)}[count_kw]
    summed = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        loss = policy_loss(
            micro[rows],
            old[rows],
            adv[rows],
            mask[rows],
            ref_logprobs=ref[rows],
            **kwargs,
            **{count_kw: count},
        ).loss
        loss.backward()
        summed = summed + loss.detach()
    torch.testing.assert_close(summed, full_loss.detach())
    torch.testing.assert_close(micro.grad, full.grad)
    # without the global count, token-mean over micro-batches of unequal size does NOT match
    if agg == "token-mean":
        naive = sum(
            policy_loss(base[r], old[r], adv[r], mask[r], ref_logprobs=ref[r], **kwargs).loss
            for r in (slice(0, 2), slice(2, 4))
        )
        assert not math.isclose(float(naive.detach()) / 2, float(full_loss.detach()), rel_tol=1e-4)


def test_truncated_importance_weights_scale_each_tokens_surrogate():
    # two tokens, on-policy for the trainer (ratio 1), advantages 1 and -1; the rollout engine's log-probs
    # differ: weights exp(old - rollout) = e^0.5 = 1.6487 and e^1.0 = 2.718 -> capped at 2
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[-0.5, -1.0]])
    weights = (old - rollout).exp().clamp(max=2.0)
    out = policy_loss(logp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), is_weights=weights)
    # token-mean of -A * ratio * w = (-1 * 1.6487 + 1 * 2) / 2
    close(out.pg_loss, (-1.6487213 + 2.0) / 2)
    out.loss.backward()
    close(logp.grad, [[-1.6487213 / 2, 2.0 / 2]])  # d(-A r w)/dlogp = -A w r / 2 tokens
