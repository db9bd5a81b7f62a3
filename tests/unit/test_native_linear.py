"""models/native/linear.c: the rollout engine's bf16 projections on AMX tiles (native.TiledLinear) against the
exact product, the packed projections (models/packed_linear.py) that use them against the model's own modules,
and a decode step's layers in one native call against the same layers called one by one.

The bound: each output is a sum of K products of bf16 values (exact in fp32) accumulated in fp32, so its error
before rounding is at most K u sum_k |x_k w_k| (u = 2^-24, any order of the sums), plus the bias's addition
(u |y|); the result is then rounded to bf16: half a bf16 ulp of it (2^-8 relative: 8 significant bits). Every check is also run
with one thing broken (the packed weight's last block of inputs dropped, the bias dropped) to show the bound
catches that.
"""

from __future__ import annotations

import pytest
import torch

from dockrl.engines.rollout.rollout_engine import Request, RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models import ModelArgs, Transformer, native
from dockrl.models.packed_linear import PackedLinear, PackedWeights
from helpers import perturb_, tiny_decoder

pytestmark = pytest.mark.skipif(
    not native.linear_available(), reason=f"native AMX projections: {native.linear_status()}"
)

U = 2.0**-24


def _within(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """y (bf16) is x @ w.T + b within the bound of the module docstring."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ w.double().abs().T
    bound = w.shape[1] * U * magnitude + U * exact.abs() + 2.0**-8 * exact.abs()
    return bool(((y.double() - exact).abs() <= bound * (1 + 1e-9)).all())


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 45, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (100, 70), (130, 256), (48, 96)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_tiled_projection_is_the_exact_product_within_fp32_accumulation(
    rows, out_features, in_features, with_bias
):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    y = native.TiledLinear(w, b)(x)
    assert y.shape == (rows, out_features) and y.dtype == torch.bfloat16
    assert _within(y, x, w, b)
    # broken on purpose: the weight's last block of 32 inputs (the tail where K is not a multiple of 32) dropped
    broken = native.TiledLinear(w, b)
    blocks = -(-in_features // 32)
    for column_block in range(-(-out_features // 16)):
        start = (column_block * blocks + blocks - 1) * 512
        broken.packed[start : start + 512] = 0
    assert not _within(broken(x), x, w, b)
    if with_bias:  # the bias dropped
        assert not _within(native.TiledLinear(w, None)(x), x, w, b)


def test_rows_with_a_stride_and_leading_dims_are_read_as_they_are():
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=generator).to(torch.bfloat16)
    wide = torch.randn(7, 200, generator=generator).to(torch.bfloat16)
    x = wide[:, 50:146]  # rows 200 apart
    tiled = native.TiledLinear(w, None)
    assert _within(tiled(x), x.contiguous(), w, None)
    batched = torch.randn(3, 5, 96, generator=generator).to(torch.bfloat16)
    out = tiled(batched)
    assert out.shape == (3, 5, 64)
    assert torch.equal(out.reshape(15, 64), tiled(batched.reshape(15, 96)))
    assert tiled(x[:0]).shape == (0, 64)


def test_the_tiled_weight_is_a_copy():
    """The engine rebuilds its packs after a weight update (PackedWeights.invalidate): until then a pack keeps
    the weights it was built from, whatever happens to the module's tensor."""
    w = torch.randn(32, 64).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    tiled = native.TiledLinear(w, None)
    before = tiled(x)
    w.mul_(-2.0)
    assert torch.equal(tiled(x), before)


def test_bad_operands_are_named():
    tiled = native.TiledLinear(torch.randn(16, 32).to(torch.bfloat16), None)
    with pytest.raises(ValueError, match="bf16"):
        tiled(torch.randn(2, 32))
    with pytest.raises(ValueError, match="32"):
        tiled(torch.randn(2, 31).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        native.TiledLinear(torch.randn(16, 32), None)


def test_the_engine_packs_on_tiles_with_the_native_kernels_and_on_onednn_without():
    model = tiny_decoder(40).to(torch.bfloat16)
    tiled, onednn = PackedWeights(model, rows=4, tiled=True), PackedWeights(model, rows=4, tiled=False)
    ids = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        with tiled.applied():
            packs = [layer.self_attn.packed for layer in model.decoder_layers()]
            assert all(pack is not None and pack[0].tiled is not None for pack in packs)
            assert model.packed_head is not None and model.packed_head.tiled is not None
            on_tiles = model(ids)
        with onednn.applied():
            assert model.packed_head is not None and model.packed_head.tiled is None
            on_onednn = model(ids)
        plain = model(ids)
    # the same sums in the same order of 32-input blocks as oneDNN's AMX kernel (hidden 32: one block each)
    assert torch.equal(on_tiles, plain) and torch.equal(on_onednn, plain)


def test_a_fused_projection_with_a_bias_on_some_sources_only_gets_zeros_for_the_others():
    """q | k | v where only q has a bias: the fused bias is q's, then zeros (before, only the biases present
    were concatenated, which did not fit the fused output)."""
    generator = torch.Generator().manual_seed(5)
    weights = [torch.randn(n, 32, generator=generator).to(torch.bfloat16) for n in (32, 16, 16)]
    bias = torch.randn(32, generator=generator).to(torch.bfloat16)
    x = torch.randn(6, 32, generator=generator).to(torch.bfloat16)
    for tiled in (True, False):
        packed = PackedLinear(weights, [bias, None, None], rows=6, tiled=tiled)
        q, k, v = packed.split(x)
        assert _within(q, x, weights[0], bias)
        assert _within(k, x, weights[1], None) and _within(v, x, weights[2], None)


def _generate(model, layout: str) -> dict:
    """Every prompt's tokens and log-probs at temperature 1, 6 prompts over 4 slots (rows join and leave)."""
    engine = RolloutEngine(model, num_slots=4, max_seq_len=40, kv_cache=layout)
    generator = torch.Generator().manual_seed(1)
    for index in range(6):
        prompt = torch.randint(0, 96, (3 + index,), generator=generator).tolist()
        engine.add(Request(prompt, [index], SamplingParams(max_new_tokens=12), tag=index))
    return {c.tag: (list(c.generation.token_ids), list(c.generation.logprobs)) for c in engine.run()}


def _family_model(family: str) -> Transformer:
    """A 2-layer bf16 decoder of `family` with heads of 32 (the grouped value sums) and random values in every
    parameter (qwen2's q, k, v biases and qwen3's per-head norms too), so each is seen by the comparison."""
    args = ModelArgs(
        family=family,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=40,
    )
    model = Transformer(args)
    perturb_(model, seed=1)
    return model.to(torch.bfloat16).eval()


@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("family", ["tiny", "qwen2", "qwen3", "llama"])
def test_a_decode_step_in_one_native_call_is_its_layers_call_by_call_bit_for_bit(monkeypatch, layout, family):
    """With every projection on tiles a decode step's layers run in one native call (linear.c decode_layers):
    the same kernels in the same order as the layers called one by one, so the same tokens and log-probs, with
    q, k, v biases (qwen2), per-head norms (qwen3) and heads of 8 (tiny) or 32. Broken on purpose (the one call
    given the layers in reverse order) the tokens differ."""
    model = tiny_decoder(40).to(torch.bfloat16) if family == "tiny" else _family_model(family)
    calls = {"fused": 0}
    decode_layers, stack = native.DecodeStep.decode_layers, native.TiledStack

    def counted(self, *args):
        calls["fused"] += 1
        return decode_layers(self, *args)

    monkeypatch.setattr(native.DecodeStep, "decode_layers", counted)
    fused = _generate(model, layout)
    assert calls["fused"] >= 12 and len(fused) == 6
    monkeypatch.setattr(native, "TiledStack", lambda layers: None)  # no stack: layer by layer
    assert _generate(model, layout) == fused
    monkeypatch.setattr(native, "TiledStack", lambda layers: stack(layers[::-1]))
    assert _generate(model, layout) != fused


def test_the_stack_follows_a_weight_update_in_place_and_rebuilds_when_a_norm_moves():
    """The stack reads the norms' weights where they are: rewritten in place (the colocated switch) it sees the
    new values; moved (a new tensor), the address guard rebuilds the packs."""
    model = tiny_decoder(40).to(torch.bfloat16)
    engine = RolloutEngine(model, num_slots=2, max_seq_len=40)
    prompt = list(range(5, 12))

    def tokens() -> list[int]:
        engine.add(Request(prompt, [3], SamplingParams(max_new_tokens=10, temperature=0.0)))
        return list(next(iter(engine.run())).generation.token_ids)

    def fresh() -> list[int]:  # an engine whose packs are built from the weights as they are now
        other = RolloutEngine(model, num_slots=2, max_seq_len=40)
        other.add(Request(prompt, [3], SamplingParams(max_new_tokens=10, temperature=0.0)))
        return list(next(iter(other.run())).generation.token_ids)

    before = tokens()
    assert before == fresh()
    norms = [layer.post_attention_layernorm.weight for layer in model.decoder_layers()]
    with torch.no_grad():
        for weight in norms:
            weight.mul_(torch.linspace(-2.0, 3.0, weight.shape[0]).to(weight.dtype))
    in_place = tokens()
    assert in_place != before and in_place == fresh()
    with torch.no_grad():
        for weight in norms:
            weight.data = weight.data.flip(0).clone()
    assert tokens() == fresh() != in_place
