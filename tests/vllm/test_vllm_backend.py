"""vLLM behind the RolloutBackend socket, in this process: weight updates equal a fresh engine, every update is
checked, and vLLM generates what dockrl's own engine generates from the same fp32 weights."""

import pytest
import torch

from dockrl.engines.rollout import vllm_backend
from dockrl.engines.rollout.rollout_engine import Request, RolloutEngine
from dockrl.engines.rollout.sampler import generate_with
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.engines.rollout.vllm_backend import VllmBackend, VllmSettings, WeightSyncError, probe_ids
from dockrl.models.hf import load_model, read_config
from dockrl.models.tiny import peaked_state_dict as peaked_weights

PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 200, 3], [44, 45, 46], [300, 2, 11, 12, 13, 14, 15]]
FP32_EPS = torch.finfo(torch.float32).eps


def _settings(path, **overrides) -> VllmSettings:
    args = read_config(path)
    base = dict(
        model_dir=str(path),
        dtype=torch.float32,
        max_model_len=128,
        max_num_seqs=8,
        memory_utilization=0.05,
        kv_cache_bytes=vllm_backend.kv_cache_bytes(args, 8, 128, torch.float32),
    )
    return VllmSettings(**{**base, **overrides})


def _model_with(path, weights):
    model = load_model(path).eval()
    model.load_state_dict(weights, strict=False)
    return model


def _reference(model) -> torch.Tensor:
    """The dockrl model's log-probs of the probe sequence (what the trainer sends with an update); the engines
    here take 128 tokens, so the probe is whole."""
    ids = probe_ids(model.args.vocab_size)
    with torch.no_grad():
        logits = model(ids[None])[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


def _run(engine, params, seeds=(1, 2, 3, 4)):
    outs = generate_with(engine, PROMPTS, params, list(seeds))
    return [(o.token_ids.tolist(), o.logprobs.tolist(), o.finish_reason) for o in outs]


SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def weight_sets(vllm_model):
    return {seed: peaked_weights(vllm_model, seed) for seed in (1, 2)}


@pytest.fixture(scope="module")
def fresh_outputs(vllm_model, weight_sets, tmp_path_factory):
    """Outputs of engines built fresh (weights read from disk) on each weight set."""
    import shutil

    from safetensors.torch import save_file

    out = {}
    for seed, weights in weight_sets.items():
        path = shutil.copytree(vllm_model, tmp_path_factory.mktemp(f"fresh{seed}") / "model")
        save_file(weights, str(path / "model.safetensors"))
        engine = VllmBackend(_settings(path, load_format="auto"))
        out[seed] = (_run(engine, SAMPLED), _run(engine, GREEDY))
        engine.close()
    return out


def test_updates_give_what_a_fresh_engine_gives(vllm_model, weight_sets, fresh_outputs):
    engine = VllmBackend(_settings(vllm_model))  # dummy weights: the first update brings them
    for seed in (1, 2, 1):  # two different weight sets, and back
        model = _model_with(vllm_model, weight_sets[seed])
        report = engine.load_weights(weight_sets[seed].items(), _reference(model))
        # bit-equal tokens and log-probs, sampled (per-request seeds) and greedy
        assert (_run(engine, SAMPLED), _run(engine, GREEDY)) == fresh_outputs[seed]
        assert report["probe_abs_diff"] < 1e-5 and report["bytes"] == sum(
            t.numel() * 4 for t in weight_sets[seed].values()
        )
    assert engine.stats["weight_updates"] == 3
    engine.close()


def test_a_stale_engine_is_caught_by_the_probe(vllm_model, weight_sets, monkeypatch):
    """vLLM's own reload leaves the tied LM head's packed copy stale on CPU: skipping the re-pack must fail
    the probe check by name, not generate from the old head."""
    engine = VllmBackend(_settings(vllm_model))
    engine.load_weights(weight_sets[1].items(), _reference(_model_with(vllm_model, weight_sets[1])))
    monkeypatch.setattr(vllm_backend, "_repack_vocab", lambda worker: 0)
    reference = _reference(_model_with(vllm_model, weight_sets[2]))
    with pytest.raises(
        WeightSyncError, match=r"rollout: after weight update 2 .* lm_head\.weight: its kernel"
    ):
        engine.load_weights(weight_sets[2].items(), reference)  # the digest sees the stale packed head
    with pytest.raises(WeightSyncError, match=r"rollout: after weight update 2 .* differ from the reference"):
        engine.check_probe(reference)  # and so does the probe, between unrelated weight sets
    engine.close()


def _dockrl_greedy(model, prompt, max_new_tokens):
    engine = RolloutEngine(model, num_slots=1, max_seq_len=64, pad_token_id=0)
    engine.add(Request(list(prompt), [0], GREEDY, tag=0))
    (completion,) = list(engine.run())
    return completion.generation


def _margins(model, prompt, tokens):
    """dockrl's gap between the best and second-best logit before each greedy token."""
    ids = torch.tensor(prompt + tokens[:-1])
    with torch.no_grad():
        logits = model(ids[None])[0, len(prompt) - 1 :].float()
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist(), float(logits.abs().max())


def _greedy_matches(engine, model, seed) -> int:
    """Greedy decoding of PROMPTS by `engine` against dockrl's `model`: tokens and log-probs agree up to each
    prompt's first near tie; returns the tokens compared."""
    compared = 0
    ours = generate_with(engine, PROMPTS, GREEDY, [0] * len(PROMPTS))
    for prompt, out in zip(PROMPTS, ours):
        theirs = _dockrl_greedy(model, prompt, 12)
        margins, largest = _margins(model, prompt, theirs.token_ids.tolist())
        # Kernels differ (oneDNN vs torch): each logit carries fp32 rounding of dot products over at most
        # K = 192 terms per layer, |error| <~ sqrt(K) x eps x |logit| per layer, over 3 layers (2 + head).
        bound = 3 * 192**0.5 * FP32_EPS * largest
        for t, margin in enumerate(margins):
            if margin <= 2 * bound:  # a near tie: either token is a correct argmax, and the rest may part
                break
            assert out.token_ids[t] == theirs.token_ids[t], (seed, prompt, t)
            assert abs(out.logprobs[t] - theirs.logprobs[t]) <= 2 * bound
            compared += 1
    return compared


def test_greedy_tokens_equal_the_dockrl_engine_at_step_0_and_after_two_updates(vllm_model, weight_sets):
    engine = VllmBackend(_settings(vllm_model))
    compared = 0
    for seed in (0, 1, 2):  # the model's own weights (step 0), then two updates
        weights = peaked_weights(vllm_model, 0) if seed == 0 else weight_sets[seed]
        model = _model_with(vllm_model, weights)
        engine.load_weights(weights.items(), _reference(model))
        compared += _greedy_matches(engine, model, seed)
    assert compared >= 100  # peaked weights: ties are rare, so nearly all 3 x 4 x 12 tokens are compared
    engine.close()


def test_sampling_repeats_with_the_same_seeds(vllm_model, weight_sets):
    engine = VllmBackend(_settings(vllm_model))
    engine.load_weights(weight_sets[1].items())
    first, again, other = (
        _run(engine, SAMPLED),
        _run(engine, SAMPLED),
        _run(engine, SAMPLED, seeds=(5, 6, 7, 8)),
    )
    assert first == again and first != other
    # each sampled token's log-prob is log_softmax(logits / T)[token] of the model: check it teacher-forced
    model = _model_with(vllm_model, weight_sets[1])
    for prompt, (tokens, logprobs, _) in zip(PROMPTS, first):
        ids = torch.tensor(prompt + tokens)
        with torch.no_grad():
            logits = model(ids[None])[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        bound = 2 * 3 * 192**0.5 * FP32_EPS * float(logits.abs().max())  # as in the greedy test
        assert (torch.tensor(logprobs) - expected).abs().max() <= bound
    engine.close()


def test_qwen3_moe_weights_stream_in_and_greedy_tokens_equal_the_dockrl_engine(tmp_path):
    """vLLM serves Qwen3-MoE: fused expert tensors stream in as per-expert checkpoint tensors, the probe check
    passes, and greedy decoding picks dockrl's tokens."""
    from dockrl.models.tiny import make_tiny

    path = make_tiny(
        tmp_path / "moe", family="qwen3_moe", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2
    )
    engine = VllmBackend(_settings(path))
    compared = 0
    for seed in (1, 2):
        weights = peaked_weights(path, seed)
        model = _model_with(path, weights)
        report = engine.load_weights(weights.items(), _reference(model))
        assert report["probe_abs_diff"] < 1e-4
        # the dense bound, with the experts' width (64) inside the 192-term dot products; a router near tie
        # would move a token's experts, which the margin check cannot see: with peaked weights router logits
        # lie ~1 apart, so a tie within fp32 rounding is a ~1e-5 event per token
        compared += _greedy_matches(engine, model, seed)
    assert compared >= 60
    engine.close()


def test_filtered_sampling_reports_the_models_logprobs_as_the_dockrl_engine_does(vllm_model, weight_sets):
    """top_p=0.7 at temperature 1 (logprobs_mode raw_logprobs, as rollout.temperature=1 picks): vLLM's sampled
    tokens' log-probs are log_softmax(logits)[token] of the model over the whole vocabulary, the dockrl engine's
    quantity (its own sampled tokens, checked the same way), within the kernels' fp32 bound of the greedy
    test. The filtered, renormalised log-probs (what processed_logprobs gives: log p - log Z) lie outside it."""
    from dockrl.backends.vllm import logprobs_mode
    from dockrl.engines.rollout.sampling import RowSettings, filter_logits

    nucleus = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.7)
    engine = VllmBackend(_settings(vllm_model, logprobs_mode=logprobs_mode(nucleus.temperature)))
    engine.load_weights(weight_sets[1].items())
    model = _model_with(vllm_model, weight_sets[1])
    runs = {
        "vllm": _run(engine, nucleus),
        "dockrl": _run(RolloutEngine(model, num_slots=4, max_seq_len=64, pad_token_id=0), nucleus),
    }
    engine.close()
    renormalised_gap = 0.0
    for name, outputs in runs.items():
        for prompt, (tokens, logprobs, _) in zip(PROMPTS, outputs):
            ids, picked = torch.tensor(prompt + tokens), torch.tensor(tokens)[:, None]
            with torch.no_grad():
                logits = model(ids[None])[0, len(prompt) - 1 : -1].float()  # [R, V]
            expected = torch.log_softmax(logits, -1).gather(-1, picked)[:, 0]
            bound = 2 * 3 * 192**0.5 * FP32_EPS * float(logits.abs().max())  # as in the greedy test
            assert (torch.tensor(logprobs) - expected).abs().max() <= bound, name
            rows = RowSettings.build([nucleus] * len(logits), "cpu")
            filtered = torch.log_softmax(filter_logits(logits, rows), -1).gather(-1, picked)[:, 0]
            renormalised_gap = max(renormalised_gap, float((torch.tensor(logprobs) - filtered).abs().max()))
    assert (
        renormalised_gap > 100 * bound
    )  # -log Z where the nucleus cut mass: the check sees which is reported
