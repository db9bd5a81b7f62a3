"""algos/estimators and the GSPO / Dr. GRPO loss variants against hand-computed numbers.

Expected values are literals worked by hand in the comments, not re-derived with the code under test.
"""

import pytest
import torch

from dockrl.algos import (
    DEFAULT_ESTIMATOR,
    aggregate,
    compute_advantages,
    gae_advantages,
    masked_moments,
    needs_batch_whitening,
    overlong_penalty,
    policy_loss,
    rloo_advantages,
    value_loss,
    whiten,
)
from helpers import close


def prefix_mask(lengths: list[int], num_tokens: int) -> torch.Tensor:
    return torch.arange(num_tokens)[None, :] < torch.tensor(lengths)[:, None]


# ---------------------------------------------------------------- group estimators


def test_rloo_leave_one_out_by_hand():
    # [1, 0, 0, 1]: the others of a 1 average 1/3 -> 2/3; of a 0 average 2/3 -> -2/3
    close(rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # [1, 2, 6]: others' means 4, 3.5, 1.5 -> -3, -1.5, 4.5 ; [3, 0] with S=2 -> +-3
    close(compute_advantages("rloo", torch.tensor([1.0, 2.0, 6.0]), 3), [-3.0, -1.5, 4.5])
    close(compute_advantages("rloo", torch.tensor([3.0, 0.0]), 2), [3.0, -3.0])
    close(rloo_advantages(torch.tensor([5.0, 1.0]), 1), [0.0, 0.0])  # no other sample -> no signal


def test_dispatcher_per_estimator_by_hand():
    rewards = torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0])
    # group [1, 2, 6]: mean 3, unbiased std sqrt((4 + 1 + 9) / 2) = sqrt(7) = 2.6457513
    close(
        compute_advantages("grpo", rewards, 3),
        [-2 / 2.6457513, -1 / 2.6457513, 3 / 2.6457513, 0.0, 0.0, 0.0],
        atol=1e-4,
    )
    close(compute_advantages("dr_grpo", rewards, 3), [-2.0, -1.0, 3.0, 0.0, 0.0, 0.0])
    close(compute_advantages("reinforce_pp_baseline", rewards, 3), [-2.0, -1.0, 3.0, 0.0, 0.0, 0.0])
    close(compute_advantages("reinforce_pp", rewards, 3), [1.0, 2.0, 6.0, 4.0, 4.0, 4.0])
    assert [needs_batch_whitening(DEFAULT_ESTIMATOR[a]) for a in ("grpo", "rloo", "reinforce_pp")] == [
        False,
        False,
        True,
    ]
    with pytest.raises(ValueError, match="unknown advantage estimator 'vtrace'"):
        compute_advantages("vtrace", rewards, 3)
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", rewards, 3)
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        compute_advantages("rloo", rewards, 4)


# ---------------------------------------------------------------- REINFORCE++ whitening


def test_whitening_over_valid_tokens_by_hand():
    # rewards [1, -2] on rows of 2 and 1 tokens -> tokens [1, 1, -2]: mean 0, population std sqrt(2)
    adv = torch.tensor([[1.0, 1.0, 7.0], [-2.0, 9.0, 9.0]])  # 7 and 9 sit on padding
    mask = prefix_mask([2, 1], 3)
    close(whiten(adv, mask), [[0.7071068, 0.7071068, 0.0], [-1.4142136, 0.0, 0.0]])
    # with the group baseline: group [1, 3] -> [-1, 1]; lengths [1, 3] -> tokens [-1, 1, 1, 1]
    # mean 0.5, population var (2.25 + 3 * 0.25) / 4 = 0.75, std 0.8660254
    baselined = compute_advantages("reinforce_pp_baseline", torch.tensor([1.0, 3.0]), 2)
    tokens = baselined[:, None].expand(2, 3).clone()
    close(
        whiten(tokens, prefix_mask([1, 3], 3)),
        [[-1.7320508, 0.0, 0.0], [0.5773503, 0.5773503, 0.5773503]],
    )


def test_whitening_with_summed_moments_equals_whole_batch_and_per_shard_does_not():
    torch.manual_seed(0)
    adv = torch.randn(8, 5)
    mask = prefix_mask([5, 1, 3, 2, 4, 5, 1, 2], 5)
    full = whiten(adv, mask)
    shards = [slice(0, 3), slice(3, 8)]  # two dp ranks with uneven token counts
    moments = sum(masked_moments(adv[s], mask[s]) for s in shards)  # what the all-reduce computes
    torch.testing.assert_close(torch.cat([whiten(adv[s], mask[s], moments=moments) for s in shards]), full)
    # whitening each shard on its own is NOT the global whitening (why the trainer all-reduces moments)
    local = torch.cat([whiten(adv[s], mask[s]) for s in shards])
    assert not torch.allclose(local, full, atol=1e-3)


# ---------------------------------------------------------------- DAPO overlong shaping


def test_overlong_penalty_by_hand():
    # max 10, buffer 4 -> free up to 6, then -1/4 per token, -1 past the limit; penalty factor 1 and 0.5
    lengths = torch.tensor([5, 6, 7, 8, 10, 11])
    close(overlong_penalty(lengths, 10, 4, 1.0), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths, 10, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 10, 11, 1.0)


# ---------------------------------------------------------------- GAE and value loss


def test_gae_with_masks_and_uneven_lengths_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])  # 9 is padding
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, 0.5, 7.0]])  # 7 is padding
    mask = prefix_mask([3, 2], 3)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.3 = 0.7 ; d1 = 0.9*0.3 - 0.4 = -0.13, A1 = -0.13 + 0.72*0.7 = 0.374
    #        d0 = 0.9*0.4 - 0.5 = -0.14, A0 = -0.14 + 0.72*0.374 = 0.12928
    # row 1: d1 = 2 - 0.5 = 1.5 (V past the end is 0) ; d0 = 0.9*0.5 - 1 = -0.55, A0 = -0.55 + 0.72*1.5 = 0.53
    close(adv, [[0.12928, 0.374, 0.7], [0.53, 1.5, 0.0]])
    close(ret, [[0.62928, 0.774, 1.0], [1.53, 2.0, 0.0]])
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t
    adv1, _ = gae_advantages(rewards, values, mask)
    close(adv1, [[0.5, 0.6, 0.7], [1.0, 1.5, 0.0]])


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.2, 5.0]])
    old = torch.tensor([[0.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 1.5, 0.0]])
    mask = prefix_mask([2], 3)  # third token is padding
    # token 0: unclipped 0, clipped V=0.2 -> (0.8)^2 = 0.64 -> 0.5 * 0.64 = 0.32
    # token 1: unclipped (1.3)^2 = 1.69, clipped V=0.8 -> 0.49; max 1.69 -> 0.845 ; mean 0.5825
    close(value_loss(values, old, returns, mask, clip=0.2), 0.5825)
    close(value_loss(values, old, returns, mask, clip=None), 0.4225)


# ---------------------------------------------------------------- Dr. GRPO and GSPO losses


def test_seq_len_norm_divides_token_sums_by_a_constant():
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 5.0, 5.0]])
    mask = prefix_mask([2, 1], 3)
    # row sums 3 and 3, each / 4, mean over rows 0.75 ; without the norm: 3
    close(aggregate(values, mask, "seq-mean-token-sum", seq_len_norm=4), 0.75)
    close(aggregate(values, mask, "seq-mean-token-sum"), 3.0)
    close(aggregate(values, mask, "token-mean", seq_len_norm=4), 6 / 3)  # ignored by other modes


def test_gspo_sequence_ratio_and_per_sequence_clip_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.2, 0.0, 5.0]], requires_grad=True)  # the 5.0 sits on padding
    mask = prefix_mask([2], 3)
    adv = torch.tensor([1.0])
    # sequence log-ratio = mean(0.2, 0.0) = 0.1 -> s = e^0.1 = 1.1051709, inside [0.8, 1.2]
    out = policy_loss(logp, old, adv, mask, sequence_ratio=True)
    close(out.pg_loss, -1.1051709)
    out.loss.backward()
    # loss = -A * s ; ds/dlogp_t = s / 2 on the two valid tokens, 0 on padding
    close(logp.grad, [[-0.5525855, -0.5525855, 0.0]])
    # clip_high 0.05: s clipped to 1.05 for the whole sequence, no gradient, clip_frac 1
    logp.grad = None
    out = policy_loss(logp, old, adv, mask, clip_high=0.05, sequence_ratio=True)
    close(out.pg_loss, -1.05)
    close(out.clip_frac, 1.0)
    out.loss.backward()
    close(logp.grad, [[0.0, 0.0, 0.0]])
    # per-token ratios for contrast: e^0.2 = 1.2214 is clipped at 1.05, e^0 = 1 is not -> (-1.05 - 1) / 2
    close(policy_loss(logp, old, adv, mask, clip_high=0.05).pg_loss, -1.025)


def test_clip_higher_acts_on_ratios_away_from_one_and_the_counts_say_which_bound():
    # Six tokens, ratios e^x: 1.35 and 1.22 (> 1 + 0.2, < 1 + 0.28), 1.0, 0.74 (< 1 - 0.2), 0.90, 1.40.
    x = torch.tensor([[0.3, 0.2, 0.0, -0.3, -0.1, 0.3364722]])  # e^0.3364722 = 1.40
    old = torch.zeros(1, 6)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 6)
    symmetric = policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # A > 0: 1.35 and 1.22 exceed 1.2 (clipped high); A < 0: 0.74 is below 0.8 (clipped low); 1.40 with A < 0
    # is the pessimistic unclipped branch (-A * 1.40 > -A * 1.2), so not counted as clipped
    close(symmetric.clip_frac_high, 2 / 6)
    close(symmetric.clip_frac_low, 1 / 6)
    close(symmetric.clip_frac, 3 / 6)
    higher = policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # clip-higher (DAPO): 1.22 now passes unclipped, 1.35 still clips; the lower bound is unchanged
    close(higher.clip_frac_high, 1 / 6)
    close(higher.clip_frac_low, 1 / 6)
    # the surrogate: mean of -A * min(r, clip(r)) for A > 0 and -A * max(r, clip(r)) for A < 0
    expected = (-1.28 - 1.2214028 - 1.0 + 0.8 + 0.9048374 + 1.4) / 6
    close(higher.pg_loss, expected)


# ---------------------------------------------------------------- micro-batch invariance


CASES = [
    # (loss kwargs, the global count each micro-batch must be given)
    ({"agg": "token-mean"}, "num_tokens"),
    ({"agg": "seq-mean-token-mean"}, "num_seqs"),
    ({"agg": "seq-mean-token-sum"}, "num_seqs"),
    ({"agg": "seq-mean-token-sum", "seq_len_norm": 6.0}, "num_seqs"),  # Dr. GRPO
    ({"agg": "token-mean", "sequence_ratio": True}, "num_tokens"),  # GSPO
    ({"agg": "seq-mean-token-mean", "sequence_ratio": True}, "num_seqs"),  # GSPO
    ({"agg": "token-mean", "clip_high": 0.28}, "num_tokens"),  # DAPO
]


@pytest.mark.parametrize("kwargs, count_kw", CASES)
def test_one_micro_batch_of_8_equals_8_of_1(kwargs, count_kw):
    torch.manual_seed(0)
    num_rows, num_tokens = 8, 6
    old = torch.randn(num_rows, num_tokens)
    base = (old + 0.3 * torch.randn(num_rows, num_tokens)).detach()
    adv = torch.randn(num_rows)
    mask = prefix_mask([6, 2, 4, 1, 3, 6, 5, 2], num_tokens)
    count = {"num_tokens": float(mask.sum()), "num_seqs": float(num_rows)}[count_kw]

    full = base.clone().requires_grad_(True)
    full_loss = policy_loss(full, old, adv, mask, **kwargs, **{count_kw: count}).loss
    full_loss.backward()
    micro = base.clone().requires_grad_(True)
    summed = sum(
        policy_loss(
            micro[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], **kwargs, **{count_kw: count}
        ).loss
        for i in range(num_rows)
    )
    summed.backward()
    torch.testing.assert_close(summed.detach(), full_loss.detach())
    torch.testing.assert_close(micro.grad, full.grad)


def test_where_micro_batches_do_not_match_without_global_counts():
    # token-mean: each single-row micro-batch averages its own tokens, so short rows weigh more.
    # seq modes: each micro-batch divides by its own row count (1), so 8 x 1 sums to 8x the loss.
    # These are why the trainer passes num_tokens / num_seqs of the whole optimizer step.
    torch.manual_seed(0)
    old = torch.randn(8, 6)
    logp = old + 0.3 * torch.randn(8, 6)
    adv = torch.randn(8)
    mask = prefix_mask([6, 2, 4, 1, 3, 6, 5, 2], 6)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        full = policy_loss(logp, old, adv, mask, agg=agg).loss
        naive = sum(
            policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], agg=agg).loss
            for i in range(8)
        )
        assert not torch.allclose(naive / 8 if agg == "token-mean" else naive, full, atol=1e-4), agg


def test_trainer_whitens_rows_of_uneven_length_over_the_step():
    from dockrl.engines.train.policy_update import whiten_rows

    # rows of 2 and 1 tokens carrying advantages 1 and -2 -> tokens [1, 1, -2]: mean 0, std sqrt(2)
    rows = whiten_rows([torch.full((2,), 1.0), torch.full((1,), -2.0)])
    assert [len(r) for r in rows] == [2, 1]
    close(torch.cat(rows), [0.7071068, 0.7071068, -1.4142136])


def test_reinforce_pp_kl_in_the_reward_is_summed_to_go():
    from dockrl.algos.estimators import kl_shaped_returns

    # a row with advantage 1.0 on its 3 tokens and per-token KL 0.5, 0.25, 1.0; kl_coef 0.1:
    # A_t = 1 - 0.1 * (KL to go) = 1 - 0.1 * [1.75, 1.25, 1.0]
    out = kl_shaped_returns(torch.ones(3), torch.tensor([0.5, 0.25, 1.0]), 0.1)
    close(out, [0.825, 0.875, 0.9])
