"""Padding-free micro-batches (actor.packing, engines/train/batch.py `Packing`): rows packed end to end give the
padded rows' log-probs, values and gradients, each row attends only its own tokens, and positions restart.

The bound on log-probs. Packed and padded passes compute every real token's result from the same inputs by the
same operations; only how fp32 sums are split may differ: the attention kernel blocks its softmax and P V sums
over T (padded) or L_i (packed) keys, and a matmul over [B T, H] or [S, H] rows may pick another blocking of its
dot products. Reassociating a sum of n fp32 terms moves it by at most (n - 1) u sum|terms| (u = 2^-24). Per token
a log-prob passes through 2 layers x 3 such reductions (attention, o_proj / MLP output, the residual's norm) + 2
in the head (logsumexp, the target's logit) = 8 reductions of at most n = 492 terms (the vocabulary; H = 64,
I = 128 and T < 40 are fewer); RMSNorm keeps what they sum O(1), so a log-prob moves by at most
8 n u (log V + |log-prob|) <= 8 x 492 x 2^-24 x (6.2 + 20) = 6.1e-3. The check is tighter in practice (below 1e-5
here), and a wrong position or a leak between rows moves log-probs by O(0.1) under these weights (perturbed to
0.1-scale, so the model is far from uniform). Gradients: helpers.GRAD_RTOL / GRAD_ATOL_OF_SCALE (sums reordered).
"""

import functools
import math

import pytest
import torch

from dockrl.config.schema import ActorConfig
from dockrl.engines.train.batch import make_micro_batch, micro_batch_rows
from dockrl.engines.train.train_engine import TrainEngine
from helpers import assert_grads_close, full_grads, perturb_

VOCAB = 492  # make_tiny's vocabulary at these settings
PROMPTS = [5, 9, 3, 14]
RESPONSES = [7, 2, 11, 20]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dockrl.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("pack") / "model", family="qwen2", hidden_size=64, num_layers=2)


def _rows(seed=0):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator) for n in PROMPTS]
    responses = [torch.randint(1, VOCAB, (n,), generator=generator) for n in RESPONSES]
    return prompts, responses


def _engine(model_dir, packing, checkpointing=False):
    optim = ActorConfig(lr=1e-3, activation_checkpointing=checkpointing)
    engine = TrainEngine(str(model_dir), device="cpu", precision="fp32", optim=optim, packing=packing)
    perturb_(engine.model, seed=3)
    return engine


def _bound(logps):
    worst = max(float(x.abs().max()) for x in logps)
    return 8 * VOCAB * 2.0**-24 * (math.log(VOCAB) + worst)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_packed_log_probs_and_gradients_equal_the_padded_ones(model_dir, checkpointing):
    prompts, responses = _rows()
    padded, packed = _engine(model_dir, False), _engine(model_dir, True, checkpointing)
    kwargs = dict(temperature=0.7, micro_batch_size=4, pad_token_id=0, max_tokens_per_micro_batch=0)
    expected, _ = padded.logprobs(prompts, responses, **kwargs)
    actual, _ = packed.logprobs(prompts, responses, **kwargs)
    bound = _bound(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=0, atol=bound)

    def step(engine):
        mb = make_micro_batch(prompts, responses, pad_token_id=0, packed=engine.packing)
        assert (mb.packing is not None) == engine.packing

        def loss_fn(stats, mb):  # a per-token weighted sum, so every position's gradient differs
            logp, entropy = stats
            weights = torch.linspace(0.5, 1.5, logp.numel()).view(logp.shape)
            return ((logp * weights + 0.1 * entropy) * mb.response_mask).sum(), {}

        engine.train_step([mb], loss_fn, forward=lambda mb: engine.token_stats(mb, 0.7))
        return full_grads(engine)

    assert_grads_close(step(packed), step(padded))


def test_packed_values_equal_the_padded_ones(model_dir):
    """The critic's pass: a value model's outputs of a packed micro-batch land on the padded grid."""
    from dockrl.models.value import value_model_kind

    prompts, responses = _rows(1)
    values = []
    for packing in (False, True):
        engine = TrainEngine(
            str(model_dir), device="cpu", precision="fp32", kind=value_model_kind(0), trainable=False,
            packing=packing,
        )  # fmt: skip
        perturb_(engine.model, seed=4)
        mb = make_micro_batch(prompts, responses, pad_token_id=0, packed=packing)
        with torch.no_grad():
            values.append(mb.unpad(engine.logits(mb)))
    scale = max(float(v.abs().max()) for v in values[0])
    for a, e in zip(values[1], values[0]):  # the head adds one more reduction of H = 64 terms
        torch.testing.assert_close(a, e, rtol=0, atol=9 * VOCAB * 2.0**-24 * (1 + scale))


def test_rows_see_only_themselves_and_positions_restart(model_dir):
    """A packed row's hidden states are those of the row alone (no other row's keys), changing every token of
    one row leaves the others' bit for bit, and the decoder computes RoPE at positions 0 .. L_i - 1 of each row.

    (RoPE scores depend on position differences only, so positions that ran on across rows would give the same
    hidden states up to rounding; they are checked where the decoder receives them. Restarting keeps the
    angles, and their fp32 rounding, those of the row alone, and a packed micro-batch within the model's
    positions however many rows it holds.)"""
    engine = _engine(model_dir, True)
    model = engine.model
    prompts, responses = _rows(2)
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    segments = (0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist())
    seen = []
    hook = model.model.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    with torch.no_grad():
        engine.token_stats(make_micro_batch(prompts, responses, pad_token_id=0, packed=True), 1.0)
    hook.remove()
    assert seen[0].tolist() == [[t for s in seqs for t in range(len(s))]]
    with torch.no_grad():
        packed = model.hidden_states(torch.cat(seqs)[None], segments=segments)[0]  # [S, H]
        for seq, start, end in zip(seqs, segments[:-1], segments[1:]):
            alone = model.hidden_states(seq[None])[0]  # [L, H], positions 0 .. L - 1
            torch.testing.assert_close(packed[start:end], alone, rtol=0, atol=1e-5)
        changed = [seqs[0], (seqs[1] + 7) % VOCAB, *seqs[2:]]
        other = model.hidden_states(torch.cat(changed)[None], segments=segments)[0]
    outside = torch.ones(segments[-1], dtype=torch.bool)
    outside[segments[1] : segments[2]] = False
    assert torch.equal(other[outside], packed[outside]), "a row saw another row's tokens"
    assert not torch.allclose(other[~outside], packed[~outside]), "the change reached the changed row"


def test_a_packed_token_budget_counts_the_tokens_computed():
    """Rows sorted longest first; padded: rows x the longest within the budget, packed: the sum of lengths."""
    lengths = [10, 40, 12, 30, 8]
    assert micro_batch_rows(lengths, 4, 64) == [[1], [3, 2], [0, 4]]  # 2 x 30 = 60, then 3 x 30 > 64
    assert micro_batch_rows(lengths, 4, 64, packed=True) == [[1], [3, 2, 0, 4]]  # 30 + 12 + 10 + 8 = 60


def test_packed_moe_replays_the_same_routes_and_counts_the_same_agreement(tmp_path):
    """MoE: the rollout's routes go to the packed tokens they belong to (replay gives the padded pass's log-probs
    and router load-balancing gradients), and the routing statistics count the same positions."""
    from dockrl.models.tiny import make_tiny

    path = make_tiny(tmp_path / "moe", family="qwen3_moe", hidden_size=32, num_heads=2, num_kv_heads=1)
    prompts, responses = _rows(5)
    prompts = [p % 400 for p in prompts]
    responses = [r % 400 for r in responses]
    generator = torch.Generator().manual_seed(6)
    routes = [  # [P + R - 1, L, k] distinct experts per token: a permutation's first two
        torch.stack(
            [torch.randperm(8, generator=generator)[:2] for _ in range((len(p) + len(r) - 1) * 2)]
        ).view(-1, 2, 2)
        for p, r in zip(prompts, responses)
    ]
    results = []
    for packing in (False, True):
        engine = _engine(path, packing)
        logps, _ = engine.logprobs(
            prompts,
            responses,
            temperature=1.0,
            micro_batch_size=4,
            pad_token_id=0,
            routes=routes,
            replay=True,
        )
        stats = engine.routing_stats.as_tensor()
        mb = make_micro_batch(
            prompts, responses, pad_token_id=0, routes=routes, moe_layers=[0, 1], packed=packing
        )

        def loss_fn(stats, mb):
            return (stats[0] * mb.response_mask).sum(), {}

        engine.train_step(
            [mb],
            loss_fn,
            forward=functools.partial(engine.token_stats, temperature=1.0),
            replay=True,
            aux_loss_coef=0.1,
        )
        results.append((logps, stats, full_grads(engine)))
    (padded, padded_stats, padded_grads), (packed, packed_stats, packed_grads) = results
    for a, e in zip(packed, padded):
        torch.testing.assert_close(a, e, rtol=0, atol=_bound(padded))
    assert torch.equal(packed_stats, padded_stats)
    assert_grads_close(packed_grads, padded_grads)
