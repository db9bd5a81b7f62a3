"""The rollout engine's paged KV cache: a long-tail batch in a pool far below max-length slots, the same tokens and
log-probs as max-length slots (bit for bit), preemption when the blocks run out, and the same tokens and log-probs
whatever the pool's size.

Log-probs of one sample decoded in different batches may differ by fp32 reassociation only (the matmuls' blocking
depends on the batch size): a relative error of a few ulps per reduction over at most 64 terms, 64 x 2^-24 ~ 4e-6
of logits of order 1, below the 1e-5 the batch-invariance tests of test_rollout_engine.py use.
"""

import pytest
import torch

from dockrl.engines.rollout.rollout_engine import BLOCK_SIZE, Request, RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models import Transformer
from helpers import tiny_decoder

FP32_BOUND = 1e-5  # see the module docstring


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_decoder(640)


def run(model, requests, **kwargs):
    engine = RolloutEngine(model, **kwargs)
    for request in requests:
        engine.add(request)
    return {(c.tag, c.sample): c.generation for c in engine.run()}, engine


def assert_same(outputs, reference):
    assert outputs.keys() == reference.keys()
    for key, generation in outputs.items():
        assert torch.equal(generation.token_ids, reference[key].token_ids), key
        assert (generation.logprobs - reference[key].logprobs).abs().max() <= FP32_BOUND, key


def long_tail(num_short: int, num_long: int, long_tokens: int) -> list[Request]:
    """Short responses and a few long ones, sampled (stop tokens off: each runs to its max_new_tokens)."""
    requests = []
    for i in range(num_short + num_long):
        new_tokens = long_tokens if i % (num_short // num_long + 1) == 0 else 3 + i % 7
        prompt = [(7 * i + j) % 96 for j in range(2 + i % 9)]
        requests.append(
            Request(prompt, [i], SamplingParams(max_new_tokens=new_tokens, temperature=1.0), tag=i)
        )
    return requests


def test_a_long_tail_fits_a_pool_max_length_slots_would_not(model):
    """The budget holds the long tail paged, in under a quarter of max-length slots (which refuse it and which
    auto does not take), and the paged samples equal the max-length slots' bit for bit: the same products per
    (row, head), only read from gathered blocks instead of in place."""
    num_slots, max_seq_len, long_tokens = 16, 16 + 512, 512
    requests = long_tail(14, 2, long_tokens)
    # Two long sequences' blocks and one block for each short one: under a quarter of the max-length slots.
    budget = 2 * (max_seq_len + BLOCK_SIZE) + 14 * BLOCK_SIZE
    assert budget < num_slots * max_seq_len / 4
    with pytest.raises(ValueError, match=r"kv_cache=slots needs num_slots x max_seq_len = 16 x 528 = 8448"):
        RolloutEngine(
            model, num_slots=num_slots, max_seq_len=max_seq_len, kv_cache="slots", kv_cache_tokens=budget
        )
    paged, engine = run(model, requests, num_slots=num_slots, max_seq_len=max_seq_len, kv_cache_tokens=budget)
    assert engine.layout == "paged"  # auto, where the slots do not fit
    assert [len(paged[(r.tag, 0)].token_ids) for r in requests] == [r.params.max_new_tokens for r in requests]
    assert engine.stats["preempted"] == 0
    sizes = engine.kv_cache_bytes()
    per_position = sizes["max_length_slots"] // (num_slots * max_seq_len)
    assert sizes["allocated"] <= (-(-budget // BLOCK_SIZE) + 1) * BLOCK_SIZE * per_position  # + scratch block
    assert sizes["max_length_slots"] > 4 * sizes["allocated"]
    slots, engine = run(model, requests, num_slots=num_slots, max_seq_len=max_seq_len)
    assert engine.layout == "slots" and engine.kv_cache_bytes()["allocated"] == sizes["max_length_slots"]
    assert paged.keys() == slots.keys()
    for key, generation in paged.items():
        assert torch.equal(generation.token_ids, slots[key].token_ids), key
        assert torch.equal(generation.logprobs, slots[key].logprobs), key
    # Unbounded, the paged pool grows only as far as the sequences reach.
    grown, engine = run(model, requests, num_slots=num_slots, max_seq_len=max_seq_len, kv_cache="paged")
    assert engine.kv_cache_bytes()["allocated"] < sizes["max_length_slots"] / 2
    assert_same(grown, slots)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_pool_that_runs_out_preempts_and_keeps_every_sample(model, temperature):
    """Four slots, blocks for three sequences at most: the youngest sample is sent back and starts over, and
    every sample equals the one drawn with room for all (greedy and sampled)."""
    params = SamplingParams(max_new_tokens=2 * BLOCK_SIZE + 5, temperature=temperature)
    requests = [
        Request([(11 * i + j) % 96 for j in range(3 + i)], [i, 50 + i], params, tag=i) for i in range(4)
    ]
    roomy, _ = run(model, requests, num_slots=4, max_seq_len=96, kv_cache="slots")
    tight, engine = run(model, requests, num_slots=4, max_seq_len=96, kv_cache_tokens=8 * BLOCK_SIZE)
    assert engine.stats["preempted"] >= 1
    assert engine.cache.peak_used <= 8
    assert_same(tight, roomy)


def test_a_sequence_the_pool_cannot_hold_is_an_error_naming_the_setting(model):
    engine = RolloutEngine(model, num_slots=2, max_seq_len=128, kv_cache_tokens=64)
    engine.add(Request([1] * 60, [0], SamplingParams(max_new_tokens=4)))  # 64 positions: two blocks
    with pytest.raises(ValueError, match=r"65 positions exceed the KV cache's kv_cache_tokens=64 \(rollout"):
        engine.add(Request([1] * 61, [0], SamplingParams(max_new_tokens=4)))
    with pytest.raises(ValueError, match="kv_cache_tokens=-1"):
        RolloutEngine(model, num_slots=2, max_seq_len=128, kv_cache_tokens=-1)
