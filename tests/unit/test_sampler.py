"""`generate` and the sampler: greedy == repeated full forwards, seeds, log-probs, stop tokens, filters.

Shape letters: B batch, T tokens, V vocabulary.
"""

import math

import pytest
import torch

from dockrl.engines.rollout.sampler import SamplingParams, generate
from dockrl.engines.rollout.sampling import RowSettings, filter_logits, inverse_cdf_sample, sample_rows
from dockrl.models import ModelArgs, Transformer

VOCAB = 300
PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 250], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7], [123, 45, 6]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    args = ModelArgs(
        family="qwen2",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        attention_bias=True,
        max_position_embeddings=64,
    )
    model = Transformer(args)
    # std 0.1 gives peaked but not degenerate next-token distributions.
    model.init_weights(seed=0, std=0.1)
    return model.eval()


@torch.no_grad()
def full_forward_logits(model: Transformer, prompt: list[int], response: torch.Tensor) -> torch.Tensor:
    """Logits [R, V] that predicted each response token, from one unpadded forward without a cache."""
    input_ids = torch.tensor(prompt + response.tolist())[None]
    return model(input_ids)[0, len(prompt) - 1 : -1].float()


@torch.no_grad()
def test_greedy_equals_argmax_of_repeated_full_forwards(model):
    generations = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0), [0] * 4)
    for prompt, generation in zip(PROMPTS, generations):
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(model(torch.tensor(ids)[None])[0, -1].argmax()))
        assert generation.token_ids.tolist() == ids[len(prompt) :]
        assert generation.finish_reason == "length"
        logits = full_forward_logits(model, prompt, generation.token_ids)
        expected = torch.log_softmax(logits, -1).gather(-1, generation.token_ids[:, None])[:, 0]
        assert (generation.logprobs - expected).abs().max().item() < 1e-5


def test_same_seed_same_output_and_batch_invariance(model):
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    alone = generate(model, [PROMPTS[1]], params, [1234])[0]
    again = generate(model, [PROMPTS[1]], params, [1234])[0]
    assert torch.equal(alone.token_ids, again.token_ids) and torch.equal(alone.logprobs, again.logprobs)
    assert len(set(alone.token_ids.tolist())) > 4  # actually sampled, not a stuck greedy loop

    # Same request at another position in a batch of 4 with other prompts of other lengths and seeds.
    batch = generate(model, [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]], params, [7, 8, 1234, 9])
    assert torch.equal(batch[2].token_ids, alone.token_ids)
    assert (batch[2].logprobs - alone.logprobs).abs().max().item() < 1e-5
    reordered = generate(model, [PROMPTS[1], PROMPTS[3], PROMPTS[2], PROMPTS[0]], params, [1234, 9, 7, 8])
    for i, j in zip([0, 1, 2, 3], [2, 3, 0, 1]):
        assert torch.equal(reordered[i].token_ids, batch[j].token_ids)


def test_different_seeds_give_different_outputs(model):
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    outputs = generate(model, [PROMPTS[0]] * 4, params, [1, 2, 3, 4])
    assert len({tuple(output.token_ids.tolist()) for output in outputs}) == 4


def test_max_batch_size_chunks_give_the_same_tokens(model):
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9)
    whole = generate(model, PROMPTS, params, [1, 2, 3, 4])
    chunked = generate(model, PROMPTS, params, [1, 2, 3, 4], max_batch_size=3)
    for a, b in zip(whole, chunked):
        assert torch.equal(a.token_ids, b.token_ids)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 0.7, 0.0), (0.9, 0, 1.0, 0.1)],
)
@torch.no_grad()
def test_logprobs_are_full_vocab_log_softmax_of_tempered_logits(model, temperature, top_k, top_p, min_p):
    """The reported log-probs are the model's at the temperature, before any filter (what the trainer
    recomputes; vLLM is made to report the same: tests/vllm). With a filter on, the filtered and renormalised
    distribution's (log p - log Z, Z the mass kept) lie well outside the bound: the check tells them apart."""
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    generations = generate(model, PROMPTS, params, [11, 12, 13, 14], pad_token_id=299)
    filtered_gap = 0.0
    for prompt, generation in zip(PROMPTS, generations):
        assert generation.logprobs.dtype == torch.float32 and generation.token_ids.dtype == torch.int64
        logits = full_forward_logits(model, prompt, generation.token_ids)  # [R, V]
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, generation.token_ids[:, None])[:, 0]
        assert (generation.logprobs - expected).abs().max().item() < 1e-5
        rows = RowSettings.build([params] * len(logits), "cpu")
        renormalised = torch.log_softmax(filter_logits(logits / temperature, rows), -1)
        renormalised = renormalised.gather(-1, generation.token_ids[:, None])[:, 0]
        filtered_gap = max(filtered_gap, (generation.logprobs - renormalised).abs().max().item())
        if top_k:
            # The filter was applied: every sampled token lies in the top-k of its step.
            rank = (logits > logits.gather(-1, generation.token_ids[:, None])).sum(-1)
            assert (rank < top_k).all()
    if (top_k, top_p, min_p) != (0, 1.0, 0.0):
        assert filtered_gap > 1e-2  # -log Z of the steps where the filter cut mass


def test_stop_token_ends_only_its_row(model):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    reference = generate(model, PROMPTS[:2], greedy, [0, 0])
    tokens = reference[0].token_ids.tolist()
    # A token that first appears at step >= 1 in row 0 and never in row 1.
    stop_index, stop_id = next(
        (i, t)
        for i, t in enumerate(tokens)
        if i >= 1 and t not in tokens[:i] and t not in reference[1].token_ids
    )
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id, VOCAB + 5])
    stopped, other = generate(model, PROMPTS[:2], params, [0, 0])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids.tolist() == tokens[: stop_index + 1]
    assert len(stopped.logprobs) == stop_index + 1
    assert other.finish_reason == "length"
    assert torch.equal(other.token_ids, reference[1].token_ids)


def test_top_k_one_equals_greedy(model):
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0), [0] * 4)
    top1 = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1), [5, 6, 7, 8])
    for a, b in zip(greedy, top1):
        assert torch.equal(a.token_ids, b.token_ids)


def test_top_k_top_p_filter_keeps_exactly_the_nucleus():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    logits = probs.log().repeat(2, 1) + torch.tensor([[0.0], [3.0]])  # a row shift must not matter

    def kept(top_k: int, top_p: float, min_p: float = 0.0) -> list[set[int]]:
        params = SamplingParams(max_new_tokens=1, top_k=top_k, top_p=top_p, min_p=min_p)
        filtered = filter_logits(logits, RowSettings.build([params] * 2, "cpu"))
        for row in range(2):  # kept entries keep their value
            keep = torch.isfinite(filtered[row])
            assert torch.equal(filtered[row][keep], logits[row][keep])
        return [set(torch.isfinite(row).nonzero()[:, 0].tolist()) for row in filtered]

    assert kept(0, 1.0) == [{0, 1, 2, 3, 4}] * 2
    assert kept(0, 0.75) == [{1, 3, 4}] * 2  # 0.4 + 0.3 = 0.7 < 0.75, so 0.15 is needed
    assert kept(0, 0.65) == [{1, 3}] * 2
    assert kept(0, 0.01) == [{1}] * 2  # the top token always survives
    assert kept(3, 1.0) == [{1, 3, 4}] * 2
    assert kept(2, 0.5) == [{1}] * 2  # top-p sees renormalized top-k mass: 0.4 / 0.7 > 0.5
    assert kept(2, 0.6) == [{1, 3}] * 2
    # Exact boundary: four equal tokens (probability exactly 0.25 each); mass 0.5 is reached by two.
    assert kept(0, 1.0, 0.5) == [{1, 3}] * 2  # min-p: p >= 0.5 * 0.4
    assert kept(0, 1.0, 0.3) == [{1, 3, 4}] * 2
    assert kept(2, 1.0, 0.9) == [{1}] * 2
    half = SamplingParams(max_new_tokens=1, top_p=0.5)
    uniform = filter_logits(torch.zeros(1, 4), RowSettings.build([half], "cpu"))
    assert torch.isfinite(uniform).sum().item() == 2


def test_inverse_cdf_never_picks_a_filtered_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).repeat(4, 1)
    # u = 0 and u on the boundary between tokens 1 and 3; u = 1 stands in for rounding up to the total.
    tokens = inverse_cdf_sample(probs, torch.tensor([0.0, 0.4999, 0.5, 1.0]))
    assert tokens.tolist() == [1, 1, 3, 3]


def test_sample_next_follows_the_filtered_distribution():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    num_draws = 4000
    logits = probs.log().repeat(num_draws, 1)  # [B, V]
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.75)
    rows = RowSettings.build([params] * num_draws, "cpu")
    tokens, logprobs = sample_rows(
        logits, rows, torch.arange(num_draws), torch.zeros(num_draws, dtype=torch.long)
    )
    counts = torch.bincount(tokens, minlength=5).float() / num_draws
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85
    assert (counts - expected).abs().max().item() < 0.03
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)  # full-vocab, unfiltered


def test_prompt_longer_than_the_position_limit_is_rejected(model):
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    generate(model, [[1] * 54], params, [0])  # exactly at the limit: 54 + 10 = 64
    with pytest.raises(ValueError, match="max_seq_len=64 = the model's max_position_embeddings=64"):
        generate(model, [[1] * 55], params, [0])
    with pytest.raises(ValueError, match="seeds"):
        generate(model, PROMPTS, params, [0])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)


def test_greedy_logprob_uses_temperature_one(model):
    generation = generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=3, temperature=0.0), [0])[0]
    logits = full_forward_logits(model, PROMPTS[0], generation.token_ids)
    assert math.isclose(
        generation.logprobs[0].item(), torch.log_softmax(logits[0], -1).max().item(), abs_tol=1e-6
    )
