"""RolloutEngine: parity with transformers, sampling distribution, seeds, stop strings, slots, log-probs.

Shape letters: R response tokens, V vocabulary.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dockrl.algos.logprobs import token_logprobs
from dockrl.engines.rollout.rollout_engine import Request, RolloutEngine
from dockrl.engines.rollout.sampling import RowSettings, SamplingParams, counter_uniforms, filter_logits
from dockrl.models import ModelArgs, Transformer
from dockrl.models.hf import load_model

VOCAB = 96
PROMPTS = [[5, 17, 42, 9, 7, 3], [11, 50], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7], [23, 45, 6], [60]]
# Upper 0.1% points of the chi-square distribution, by degrees of freedom (standard tables).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124}


def tiny_model(vocab_size: int = VOCAB, std: float = 0.1, seed: int = 0) -> Transformer:
    args = ModelArgs(
        family="qwen2",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
        max_position_embeddings=64,
    )
    model = Transformer(args)
    model.init_weights(seed=seed, std=std)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model()


def run_engine(model, requests, num_slots, max_seq_len=64, **kwargs):
    """All completions keyed by (tag, sample), plus the engine (for its stats)."""
    engine = RolloutEngine(model, num_slots=num_slots, max_seq_len=max_seq_len, **kwargs)
    for request in requests:
        engine.add(request)
    return {(c.tag, c.sample): c.generation for c in engine.run()}, engine


@torch.no_grad()
def test_greedy_equals_transformers_generate(tmp_path):
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.15)
    hf_model.save_pretrained(tmp_path)
    ours = load_model(tmp_path).eval()
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    # 2 slots for 5 prompts: later prompts run in slots freed by earlier ones.
    requests = [Request(prompt, [0], greedy, tag=i) for i, prompt in enumerate(PROMPTS)]
    outputs, _ = run_engine(ours, requests, num_slots=2)
    for i, prompt in enumerate(PROMPTS):
        expected = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :]
        assert outputs[(i, 0)].token_ids.tolist() == expected.tolist()


@torch.no_grad()
def test_sampled_first_tokens_follow_the_filtered_distribution():
    small = tiny_model(vocab_size=8, std=0.3, seed=3)
    prompt, num_draws = [1, 2, 3], 3000
    params = SamplingParams(max_new_tokens=1, temperature=0.9, top_k=6, min_p=0.05)
    outputs, engine = run_engine(
        small, [Request(prompt, list(range(num_draws)), params)], num_slots=num_draws, max_seq_len=4
    )
    assert engine.stats["prefill_prompts"] == 1  # 3000 samples, one prefill
    tokens = torch.tensor([outputs[(None, i)].token_ids[0].item() for i in range(num_draws)])
    counts = torch.bincount(tokens, minlength=8).double()  # [V]
    logits = small(torch.tensor([prompt]))[0, -1].float() / 0.9
    intended = torch.softmax(filter_logits(logits[None], RowSettings.build([params], "cpu"))[0], -1).double()
    kept = intended > 0
    assert 2 <= kept.sum() < 8 and counts[~kept].sum() == 0  # the filters bite and are respected

    def chi_square(probs: torch.Tensor) -> float:
        expected = probs[kept] * num_draws
        return float(((counts[kept] - expected) ** 2 / expected).sum())

    degrees = int(kept.sum()) - 1
    assert chi_square(intended) < CHI2_999[degrees]
    # The same statistic rejects a temperature mix-up (1.2 instead of 0.9) on the same kept set: it has power.
    mixed_up = torch.softmax(logits.double() * 0.9 / 1.2, -1)
    assert chi_square(mixed_up / mixed_up[kept].sum()) > CHI2_999[degrees]


def test_counter_uniforms_match_a_reference_splitmix64():
    mask = (1 << 64) - 1

    def reference(seed: int, step: int) -> float:
        z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        return (z >> 11) / float(1 << 53)

    seeds = [0, 1, 12345, 2**62 + 7, 2**63 - 2]
    steps = [0, 3, 1000, 5, 127]
    got = counter_uniforms(torch.tensor(seeds), torch.tensor(steps)).tolist()
    assert got == [reference(seed, step) for seed, step in zip(seeds, steps)]
    many = counter_uniforms(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    assert abs(many.mean().item() - 0.5) < 0.01 and 0.0 <= many.min() and many.max() < 1.0


def test_batch_invariance_any_companions_any_order(model):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95)
    target = Request(PROMPTS[1], [1234], params, tag="target")
    alone, _ = run_engine(model, [target], num_slots=1)
    assert len(set(alone[("target", 0)].token_ids.tolist())) > 4  # really sampled

    others = [
        Request(p, [7 + i, 99 + i], params, tag=i) for i, p in enumerate([PROMPTS[0], PROMPTS[2], PROMPTS[3]])
    ]
    short = SamplingParams(max_new_tokens=3, temperature=0.7)
    others.append(Request(PROMPTS[4], [5], short, tag="short"))
    for order, num_slots in [
        (others + [target], 3),
        ([target] + others[::-1], 8),
        (others[:2] + [target] + others[2:], 2),
    ]:
        mixed, _ = run_engine(model, order, num_slots=num_slots)
        assert torch.equal(mixed[("target", 0)].token_ids, alone[("target", 0)].token_ids)
        assert (mixed[("target", 0)].logprobs - alone[("target", 0)].logprobs).abs().max() < 1e-5


def test_a_long_tail_decodes_only_the_running_rows_with_the_same_tokens(model):
    # Slot 7 runs long while slots 0-6 finish early: it moves to slot 0 once, and the late steps decode one row.
    long = SamplingParams(max_new_tokens=24, temperature=1.0)
    short = SamplingParams(max_new_tokens=2, temperature=1.0)
    requests = [Request(PROMPTS[1 + i % 4], [40 + i], short, tag=i) for i in range(7)]
    requests += [Request(PROMPTS[0], [3], long, tag="long")]
    mixed, engine = run_engine(model, requests, num_slots=8)
    assert engine.stats["compactions"] == 1 and engine.stats["moved_rows"] == 1
    # each short sample is decoded once (its first token comes from the prefill), the long one 23 times
    assert engine.stats["decode_rows"] == 7 + 23
    for request in requests:
        alone, _ = run_engine(model, [request], num_slots=1)
        assert torch.equal(mixed[(request.tag, 0)].token_ids, alone[(request.tag, 0)].token_ids)
        assert (mixed[(request.tag, 0)].logprobs - alone[(request.tag, 0)].logprobs).abs().max() < 1e-5


def test_compaction_between_admissions_keeps_every_sample(model):
    """More requests than slots, of mixed lengths: samples move down while others are admitted into freed
    slots, and every sample equals the same request run alone."""
    requests = [
        Request(PROMPTS[i % 5], [60 + i], SamplingParams(max_new_tokens=(3, 17, 2, 9, 1, 12)[i % 6]), tag=i)
        for i in range(11)
    ]
    mixed, engine = run_engine(model, requests, num_slots=6)
    assert engine.stats["compactions"] >= 1 and engine.stats["moved_rows"] >= 1
    for request in requests:
        alone, _ = run_engine(model, [request], num_slots=1)
        assert torch.equal(mixed[(request.tag, 0)].token_ids, alone[(request.tag, 0)].token_ids)
        assert (mixed[(request.tag, 0)].logprobs - alone[(request.tag, 0)].logprobs).abs().max() < 1e-5


def test_shared_prefill_samples_equal_single_requests(model):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    grouped, engine = run_engine(model, [Request(PROMPTS[0], [1, 2, 3, 4], params, tag="g")], num_slots=4)
    assert engine.stats["prefill_prompts"] == 1
    assert len({tuple(grouped[("g", i)].token_ids.tolist()) for i in range(4)}) == 4
    for i, seed in enumerate([1, 2, 3, 4]):
        single, _ = run_engine(model, [Request(PROMPTS[0], [seed], params)], num_slots=1)
        assert torch.equal(single[(None, 0)].token_ids, grouped[("g", i)].token_ids)


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_requests_with_the_same_prompt_share_one_prefilled_row(model, layout):
    """A group's samples sent as one request each (multi-turn trajectories are) and admitted together: their
    prompt is prefilled once, and each draws what it draws as one request with all the seeds (the same rows in
    the same slots: the same sums, bit for bit)."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    seeds = [1, 2, 3, 4]
    requests = [Request(PROMPTS[0], [seed], params, tag=("a", i)) for i, seed in enumerate(seeds)]
    requests += [
        Request(PROMPTS[1], [9], params, tag=("b", 0)),
        Request(PROMPTS[1], [8], params, tag=("b", 1)),
    ]
    split, engine = run_engine(model, requests, num_slots=6, kv_cache=layout)
    assert engine.stats["prefill_prompts"] == 2 and engine.stats["prefill_tokens"] == len(PROMPTS[0]) + len(
        PROMPTS[1]
    )
    grouped, _ = run_engine(
        model, [Request(PROMPTS[0], seeds, params, tag="a"), Request(PROMPTS[1], [9, 8], params, tag="b")], 6
    )
    for ((name, i), _), generation in split.items():
        assert torch.equal(generation.token_ids, grouped[(name, i)].token_ids), (name, i)
        assert torch.equal(generation.logprobs, grouped[(name, i)].logprobs), (name, i)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.0), (1.3, 0, 1.0, 0.1)]
)
@torch.no_grad()
def test_logprobs_match_the_trainer(model, temperature, top_k, top_p, min_p):
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    requests = [Request(p, [11 + i, 50 + i], params, tag=i) for i, p in enumerate(PROMPTS)]
    outputs, _ = run_engine(model, requests, num_slots=3)
    for (tag, _), generation in outputs.items():
        prompt = PROMPTS[tag]
        assert generation.logprobs.dtype == torch.float32 and generation.token_ids.dtype == torch.int64
        logits = model(torch.tensor(prompt + generation.token_ids.tolist())[None])[0, len(prompt) - 1 : -1]
        trainer = token_logprobs(logits, generation.token_ids, temperature=temperature)  # [R]
        assert (generation.logprobs - trainer).abs().max().item() < 1e-5


def test_finished_slots_are_reused_at_once(model):
    def params(n):
        return SamplingParams(max_new_tokens=n, temperature=0.0)

    requests = [Request(PROMPTS[0], [0], params(10), tag="A")]
    requests += [Request(PROMPTS[i], [0], params(2), tag=t) for i, t in [(1, "B"), (2, "C"), (3, "D")]]
    engine = RolloutEngine(model, num_slots=2, max_seq_len=32)
    for request in requests:
        engine.add(request)
    order = [completion.tag for completion in engine.run()]
    assert order == ["B", "C", "D", "A"]
    # A's 10 tokens: 1 from its prefill + 9 decode steps; B, C, D each ran inside those 9 steps.
    assert engine.stats["decode_steps"] == 9
    assert (
        engine.stats["prefill_calls"] == 3
        and engine.stats["prefill_prompts"] == 4
        and not engine.has_work()
        and engine.num_free_slots() == 2
    )


def test_stop_strings_cut_at_the_completing_token(model):
    def detokenize(ids: list[int]) -> str:
        return "".join(f"<{t % 5}>" for t in ids)

    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    reference, _ = run_engine(model, [Request(PROMPTS[0], [0], greedy)], num_slots=1)
    residues = [t % 5 for t in reference[(None, 0)].token_ids.tolist()]
    target = next(r for r in residues[1:] if r != residues[0])
    # "><r" spans two tokens: it completes at the first token with residue r that has a predecessor.
    spanning = 1 + residues[1:].index(target)
    inside = residues.index(target)  # "r>" lies inside one token

    for stop, cut in [(f"><{target}", spanning), (f"{target}>", inside), ("never", None)]:
        params = SamplingParams(max_new_tokens=20, temperature=0.0, stop_strings=[stop])
        outputs, _ = run_engine(model, [Request(PROMPTS[0], [0], params)], num_slots=1, detokenize=detokenize)
        generation = outputs[(None, 0)]
        if cut is None:
            assert generation.finish_reason == "length" and len(generation.token_ids) == 20
        else:
            assert generation.finish_reason == "stop"
            assert generation.token_ids.tolist() == reference[(None, 0)].token_ids.tolist()[: cut + 1]


def test_stop_token_ends_only_its_sample(model):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    reference, _ = run_engine(
        model, [Request(PROMPTS[0], [0], greedy, tag=0), Request(PROMPTS[1], [0], greedy, tag=1)], 2
    )
    tokens, other = reference[(0, 0)].token_ids.tolist(), reference[(1, 0)].token_ids.tolist()
    index, stop_id = next(
        (i, t) for i, t in enumerate(tokens) if i >= 1 and t not in tokens[:i] and t not in other
    )
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id])
    outputs, _ = run_engine(
        model, [Request(PROMPTS[0], [0], params, tag=0), Request(PROMPTS[1], [0], params, tag=1)], 2
    )
    assert (
        outputs[(0, 0)].finish_reason == "stop" and outputs[(0, 0)].token_ids.tolist() == tokens[: index + 1]
    )
    assert outputs[(1, 0)].finish_reason == "length" and outputs[(1, 0)].token_ids.tolist() == other


def test_requests_that_cannot_fit_are_errors_naming_the_limit(model):
    engine = RolloutEngine(model, num_slots=2, max_seq_len=32)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    engine.add(Request([1] * 27, [0], params))  # exactly at the limit
    with pytest.raises(
        ValueError, match=r"28 tokens \+ max_new_tokens=5 = 33 exceeds the cache limit max_seq_len=32"
    ):
        engine.add(Request([1] * 28, [0], params))
    with pytest.raises(ValueError, match="num_slots=2"):
        engine.add(Request([1], [0, 1, 2], params))
    with pytest.raises(ValueError, match="detokenize"):
        engine.add(Request([1], [0], SamplingParams(max_new_tokens=2, stop_strings=["x"])))
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        RolloutEngine(model, num_slots=1, max_seq_len=65)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(max_new_tokens=2, min_p=1.0)


def test_load_weights_equals_a_fresh_engine_with_those_weights():
    """RolloutBackend.load_weights: an engine that loads another model's weights samples exactly what an engine
    built on that model samples (same greedy and seeded tokens, same log-probs bit for bit: the same kernels on
    the same values). Refused while requests run, and for a name or shape the model lacks."""
    from dockrl.engines.rollout import RolloutBackend

    other = tiny_model(seed=1)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    requests = [Request(tag=i, prompt_ids=p, params=params, seeds=[i, i + 7]) for i, p in enumerate(PROMPTS)]
    expected, _ = run_engine(other, requests, num_slots=4)
    engine = RolloutEngine(tiny_model(seed=0), num_slots=4, max_seq_len=64)
    assert isinstance(engine, RolloutBackend)
    engine.load_weights((name, p.detach().clone()) for name, p in other.named_parameters())
    for request in requests:
        engine.add(request)
    got = {(c.tag, c.sample): c.generation for c in engine.run()}
    assert got.keys() == expected.keys()
    for key, generation in got.items():
        assert torch.equal(generation.token_ids, expected[key].token_ids), key
        assert torch.equal(generation.logprobs, expected[key].logprobs), key
    engine.add(requests[0])
    with pytest.raises(RuntimeError, match="while requests run"):
        engine.load_weights([])
    list(engine.run())
    with pytest.raises(ValueError, match="does not have"):
        engine.load_weights([("no.such.weight", torch.zeros(1))])
    name, param = next(iter(other.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, torch.zeros(param.numel() + 1))])
