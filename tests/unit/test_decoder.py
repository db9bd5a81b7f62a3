"""Decoder model: KV-cache and padding equivalences, causality, config round trips, parity with transformers.

Shape letters: B batch, T tokens, V vocabulary.
"""

import pytest
import torch

from dockrl.models import KVCache, ModelArgs, Transformer
from dockrl.models.decoder import rope_inv_freq
from dockrl.models.kv_cache import attention_mask, grouped_attention, row_offset_bias

VOCAB = 300


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_args(family: str, **overrides) -> ModelArgs:
    """Hidden 64, 2 layers, GQA 4:2; qwen3 gets head_dim 24 != 64 / 4 to exercise an explicit head_dim."""
    fields = dict(
        family=family,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24 if family == "qwen3" else 16,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=256,
    )
    fields.update(overrides)
    return ModelArgs(**fields)


def tiny_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """Random model with non-trivial norms and biases, so a mix-up of either shows in the logits."""
    model = Transformer(args)
    model.init_weights(seed=seed, std=0.2)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


FAMILY_ARGS = {
    "llama": tiny_args("llama"),
    "llama3_rope_bias_tied": tiny_args(
        "llama",
        attention_bias=True,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
    ),
    "qwen2": tiny_args("qwen2"),
    "qwen3": tiny_args("qwen3"),
    "qwen3_bias_tied": tiny_args("qwen3", attention_bias=True, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(FAMILY_ARGS))
def model(request) -> Transformer:
    return tiny_model(FAMILY_ARGS[request.param])


@torch.no_grad()
def test_kv_cache_incremental_decoding_equals_full_forward(model):
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    full = model(input_ids)  # [B, T, V]
    cache = KVCache(model.args, batch_size=2, max_len=16, dtype=torch.float32, device="cpu")
    # Prefill 5, a chunk of 3, then one token at a time.
    chunks = [(0, 5), (5, 8)] + [(t, t + 1) for t in range(8, 12)]
    pieces = [model(input_ids[:, start:end], kv_cache=cache, cache_offset=start) for start, end in chunks]
    incremental = torch.cat(pieces, dim=1)
    assert (incremental - full).abs().max().item() < 1e-5
    assert full.abs().max().item() > 1.0  # the comparison is not between near-zero logits


@torch.no_grad()
def test_left_padded_batch_equals_rows_alone(model):
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (length,), generator=generator) for length in (9, 4, 7)]
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    key_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = row
        key_mask[i, width - len(row) :] = True
    position_ids = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    batched = model(input_ids, position_ids=position_ids, key_mask=key_mask)  # [B, T, V]
    assert torch.isfinite(batched).all()  # padding queries see only themselves, never NaN

    cache = KVCache(model.args, batch_size=len(rows), max_len=width + 2, dtype=torch.float32, device="cpu")
    model(input_ids, position_ids=position_ids, key_mask=key_mask, kv_cache=cache)
    next_ids = torch.tensor([[5], [6], [7]])
    next_positions = position_ids[:, -1:] + 1
    next_mask = torch.cat([key_mask, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
    decoded = model(next_ids, next_positions, next_mask, kv_cache=cache, cache_offset=width)[:, 0]  # [B, V]

    for i, row in enumerate(rows):
        alone = model(torch.cat([row, next_ids[i]])[None])[0]  # [T, V]
        assert (batched[i, width - len(row) :] - alone[:-1]).abs().max().item() < 1e-5
        assert (decoded[i] - alone[-1]).abs().max().item() < 1e-5


def test_attention_mask_is_causal_padded_and_never_empty():
    key_mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    mask = attention_mask(key_mask, batch=2, seq=2, cache_offset=3, has_cache=True, device="cpu")[:, 0]
    assert mask.tolist() == [
        [[False, False, True, True, False], [False, False, True, True, True]],
        [[True, True, True, True, False], [True, True, True, True, True]],
    ]
    # A left-padding query sees no real key; it attends to itself so no softmax row is empty (NaN).
    prefill = attention_mask(key_mask[:, :3], batch=2, seq=3, cache_offset=0, has_cache=False, device="cpu")
    assert prefill[0, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert attention_mask(None, 2, 3, 0, has_cache=False, device="cpu") is None


def test_row_offset_bias_is_causal_from_each_rows_offset_and_padded():
    key_mask = torch.tensor([[True, False, True, True, True], [True, True, True, True, True]])
    bias = row_offset_bias(key_mask, torch.tensor([2, 3]), seq=2, dtype=torch.float32)[:, 0]
    inf = float("-inf")
    assert bias.tolist() == [
        [[0.0, inf, 0.0, inf, inf], [0.0, inf, 0.0, 0.0, inf]],  # row 0 from slot 2; slot 1 is padding
        [[0.0, 0.0, 0.0, 0.0, inf], [0.0, 0.0, 0.0, 0.0, 0.0]],  # row 1 from slot 3
    ]


def test_grouped_attention_equals_the_masked_scaled_softmax():
    """The rollout's decode attention adds the bias and the scale in one pass over the scores; the same numbers
    as scaling, then filling the masked scores, then softmax, per query head over its kv head's keys."""
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, keys, dim = 3, 4, 2, 2, 7, 16
    q = torch.randn(batch, heads, seq, dim)
    k, v = torch.randn(batch, kv_heads, keys, dim), torch.randn(batch, kv_heads, keys, dim)
    key_mask = torch.ones(batch, keys, dtype=torch.bool)
    key_mask[0, :2] = False
    k[0, :, :2] = 50.0  # padded keys that would dominate the softmax if the bias let them through
    offsets = torch.tensor([5, 3, 4])
    bias = row_offset_bias(key_mask, offsets, seq, torch.float32)  # [B, 1, T, S]
    out = grouped_attention(q, k, v, bias)
    group = heads // kv_heads
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    for b in range(batch):
        for n in range(heads):
            masked = bias[b, 0] != 0  # [T, S]
            scores = (q[b, n] @ k_rep[b, n].T) * dim**-0.5  # [T, S]
            expected = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1) @ v_rep[b, n]
            # The same products in another summation order (fp32, u = 2^-24): an attended score moves by at most
            # D u x its magnitude (sum of |q_d k_d| x scale); a softmax weight by 2 x the largest such move in
            # sum, so the output by that x max|v|; the weighted sum over S keys adds S u x max|v|, rounding u.
            magnitude = (q[b, n].abs() @ k_rep[b, n].abs().T * dim**-0.5).masked_fill(masked, 0).max()
            v_max = v_rep[b, n].abs().max()
            atol = (2 * dim * 2**-24 * magnitude + (keys + 1) * 2**-24) * v_max
            torch.testing.assert_close(out[b, n], expected, rtol=0, atol=float(atol))
    # padding, future slots: row 0's queries never see slots 0-1, row 1's first query not slot 4
    assert out[0].abs().max() < 10 and torch.isfinite(out).all()


@torch.no_grad()
def test_causal_later_tokens_do_not_change_earlier_logits(model):
    input_ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    changed = input_ids.clone()
    changed[0, 6] = (changed[0, 6] + 1) % VOCAB
    before, after = model(input_ids), model(changed)
    assert torch.equal(before[:, :6], after[:, :6])
    assert (before[:, 6:] - after[:, 6:]).abs().max().item() > 1e-3


@torch.no_grad()
def test_position_ids_are_used(model):
    # RoPE is shift-invariant, so only a gap in the positions (not an offset) may change the logits.
    input_ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    contiguous = model(input_ids)
    assert torch.allclose(model(input_ids, position_ids=torch.arange(8)[None] + 5), contiguous, atol=1e-5)
    gapped = model(input_ids, position_ids=torch.tensor([[0, 1, 2, 3, 20, 21, 22, 23]]))
    assert torch.equal(gapped[:, :4], contiguous[:, :4])
    assert (gapped[:, 4:] - contiguous[:, 4:]).abs().max().item() > 1e-3


def test_num_params_and_hf_parameter_names(model):
    args = model.args
    assert args.num_params() == sum(param.numel() for param in model.parameters())
    names = set(model.state_dict())
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert ("lm_head.weight" in names) != args.tie_word_embeddings
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (args.family == "qwen3")
    assert ("model.layers.1.self_attn.k_proj.bias" in names) == args.attention_bias
    assert ("model.layers.1.self_attn.o_proj.bias" in names) == (
        args.attention_bias and args.family != "qwen2"
    )


def test_tied_embeddings_use_the_embedding_weight():
    model = tiny_model(tiny_args("llama", tie_word_embeddings=True))
    assert "lm_head.weight" not in model.state_dict()
    assert not hasattr(model, "lm_head")
    assert model.output_weight() is model.model.embed_tokens.weight
    hidden = model.hidden_states(torch.tensor([[1, 2, 3]]))
    expected = hidden @ model.model.embed_tokens.weight.T
    assert torch.allclose(model(torch.tensor([[1, 2, 3]])), expected, atol=1e-6)


def test_init_weights_is_seeded():
    first, second, other = (Transformer(tiny_args("qwen2")) for _ in range(3))
    first.init_weights(seed=3)
    second.init_weights(seed=3)
    other.init_weights(seed=4)
    for (name, a), b, c in zip(first.named_parameters(), second.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if name.endswith("bias"):
            assert torch.equal(a, torch.zeros_like(a))
        elif "norm" in name:
            assert torch.equal(a, torch.ones_like(a))
        else:
            assert not torch.equal(a, c), name
            assert abs(a.std().item() - 0.02) < 0.005, name


@pytest.mark.parametrize("name", list(FAMILY_ARGS))
def test_model_args_round_trip_through_hf_config(name):
    transformers = pytest.importorskip("transformers")
    args = FAMILY_ARGS[name]
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    # A config that transformers itself loaded and re-serialized (transformers 5 rope_parameters layout).
    hf_dict = transformers.AutoConfig.for_model(**args.to_hf_config()).to_dict()
    assert ModelArgs.from_hf_config(hf_dict) == args


def test_from_hf_config_reads_legacy_checkpoint_layouts():
    llama31 = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "eos_token_id": [128001, 128008, 128009],
    }
    args = ModelArgs.from_hf_config(llama31)
    assert (args.head_dim, args.num_kv_heads, args.rope_theta) == (128, 8, 500000.0)
    assert args.rope_scaling["factor"] == 8.0 and args.eos_token_id == [128001, 128008, 128009]
    assert args.num_params() == 8_030_261_248  # Llama-3.1-8B
    qwen2 = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
    }
    args = ModelArgs.from_hf_config(qwen2)
    assert args.attention_bias and args.head_dim == 64 and args.rope_scaling is None
    assert args.num_params() == 494_032_768  # Qwen2.5-0.5B


def test_invalid_configs_name_the_setting():
    with pytest.raises(ValueError, match="model_type='gpt2'.*llama.*qwen2.*qwen3"):
        ModelArgs.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling.*yarn"):
        tiny_args("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="attention_bias=True"):
        tiny_args("qwen2", attention_bias=False)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        tiny_args("llama", num_kv_heads=3)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArgs.from_hf_config(tiny_args("qwen3").to_hf_config() | {"use_sliding_window": True})


def test_llama3_rope_frequencies_equal_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = tiny_args("llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    hf_config = transformers.LlamaConfig(**args.to_hf_config())
    expected, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(args)
    assert attention_scaling == 1.0
    assert torch.equal(ours, expected)
    plain = rope_inv_freq(tiny_args("llama", rope_theta=500000.0))
    # The tiny head_dim still spans all three llama3 regimes: kept, smoothed, divided by factor.
    assert (ours == plain).any()
    assert torch.isclose(ours, plain / 8.0).any()
    assert ((ours < plain) & ~torch.isclose(ours, plain / 8.0)).any()


@pytest.mark.parametrize("name", list(FAMILY_ARGS))
@torch.no_grad()
def test_logits_match_transformers(name):
    transformers = pytest.importorskip("transformers")
    args = FAMILY_ARGS[name]
    ours = tiny_model(args)
    config = transformers.AutoConfig.for_model(**args.to_hf_config())
    config._attn_implementation = "eager"
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert type(theirs).__name__ == args.to_hf_config()["architectures"][0]
    result = theirs.load_state_dict(ours.state_dict(), strict=not args.tie_word_embeddings)
    if args.tie_word_embeddings:
        assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
        theirs.tie_weights()
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, :6] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    expected = theirs(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    actual = ours(input_ids, position_ids=position_ids, key_mask=attention_mask.bool())
    real = attention_mask.bool()
    assert (expected - actual)[real].abs().max().item() < 1e-4
    assert expected.abs().max().item() > 1.0


def test_activation_checkpointing_gives_the_same_gradients():
    """checkpoint_layers (actor.activation_checkpointing) recomputes each layer's forward in the backward pass:
    the same ops on the same inputs in the same order, so loss and every gradient are bitwise equal."""
    model = tiny_model(FAMILY_ARGS["qwen2"]).train()
    input_ids = torch.randint(0, model.args.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        model.model.checkpoint_layers = recompute
        loss = model(input_ids).float().logsumexp(-1).mean()
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.model.checkpoint_layers = False
    (loss_plain, plain), (loss_ckpt, ckpt) = grads
    assert torch.equal(loss_plain, loss_ckpt)
    assert all(torch.equal(plain[n], ckpt[n]) for n in plain)
    with torch.no_grad():  # inference never recomputes (nothing is kept for a backward pass)
        model.model.checkpoint_layers = True
        assert torch.equal(model(input_ids), model.eval()(input_ids))
    model.model.checkpoint_layers = False
