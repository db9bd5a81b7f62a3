"""The rollout engine's packed, fused projections on a CPU (models/packed_linear.py): bit-identical outputs,
the same tokens and log-probs as the model's own modules, rebuilt after every weight update, never left on the
model for a training forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dockrl.engines.rollout.rollout_engine import Request, RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models import Transformer
from dockrl.models.lora import LoRALinear, LoraSpec
from dockrl.models.packed_linear import PackedLinear, PackedWeights, supported
from helpers import tiny_decoder

pytestmark = pytest.mark.skipif(
    not supported(tiny_decoder(64).to(torch.bfloat16)),
    reason="this CPU's oneDNN does not compute bf16 (packing applies to bf16 only)",
)


@pytest.fixture
def model() -> Transformer:
    model = tiny_decoder(64)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # q, k, v biases that matter (init_weights zeroes them)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.to(torch.bfloat16)


def generate(model: Transformer, pack: bool, num_prompts: int = 6) -> dict:
    """Every prompt's tokens and log-probs, sampled at temperature 1 (prompts of 3 to 3 + num_prompts tokens)."""
    engine = RolloutEngine(model, num_slots=4, max_seq_len=40, pack_weights=pack)
    generator = torch.Generator().manual_seed(1)
    for index in range(num_prompts):
        prompt = torch.randint(0, 96, (3 + index,), generator=generator).tolist()
        engine.add(Request(prompt, [index, 100 + index], SamplingParams(max_new_tokens=12), tag=index))
    return {
        (c.tag, c.sample): (list(c.generation.token_ids), [float(x) for x in c.generation.logprobs])
        for c in engine.run()
    }


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_fused_packed_projection_equals_the_separate_linears_bit_for_bit(model, rows):
    attn = model.decoder_layers()[0].self_attn
    x = torch.randn(rows, 3, 32).to(torch.bfloat16)  # [B, T, H]
    packed = PackedLinear.of([attn.q_proj, attn.k_proj, attn.v_proj], rows=8)
    for got, linear in zip(packed.split(x), (attn.q_proj, attn.k_proj, attn.v_proj)):
        assert torch.equal(got, F.linear(x, linear.weight, linear.bias))


def test_the_engine_draws_the_same_tokens_and_log_probs_packed_or_not(model):
    packed = generate(model, pack=True)
    assert len(packed) == 12
    assert packed == generate(model, pack=False)


def test_every_layer_and_the_head_are_packed_and_none_is_left_on_the_model(model):
    engine = RolloutEngine(model, num_slots=2, max_seq_len=40)
    assert engine.packed is not None
    with engine.packed.applied():
        assert all(layer.self_attn.packed is not None for layer in model.decoder_layers())
        assert all(layer.mlp.packed is not None for layer in model.decoder_layers())
        assert model.packed_head is not None
    # outside the engine's model calls the model is its own: a training forward never sees the packs
    assert all(
        layer.self_attn.packed is None and layer.mlp.packed is None for layer in model.decoder_layers()
    )
    assert model.packed_head is None
    assert RolloutEngine(model.float(), num_slots=2, max_seq_len=40).packed is None  # fp32: not packed


def test_packs_are_rebuilt_after_weights_change_in_place(model):
    """The colocated switch rewrites the buffers the parameters view: no version counter shows it, so the engine
    is told (`weights_changed`, which DockrlRollout.sync calls). Without it the packs are stale: the check sees
    the difference."""
    engine = RolloutEngine(model, num_slots=4, max_seq_len=40)
    prompt = list(range(5, 12))

    def tokens(engine: RolloutEngine) -> list[int]:
        engine.add(Request(prompt, [3], SamplingParams(max_new_tokens=10, temperature=0.0)))
        return list(next(iter(engine.run())).generation.token_ids)

    before = tokens(engine)
    with torch.no_grad():
        for layer in model.decoder_layers():  # rewrite in place, as a bucket refill does
            layer.mlp.down_proj.weight.data.mul_(-3.0)
            layer.self_attn.q_proj.weight.data.mul_(2.0)
    fresh = tokens(RolloutEngine(model, num_slots=4, max_seq_len=40, pack_weights=False))
    assert fresh != before
    assert tokens(engine) == before  # stale packs: the old weights' tokens
    engine.weights_changed()
    assert tokens(engine) == fresh


def test_a_lora_layer_runs_through_its_own_module(model):
    """A layer whose projection is not a plain nn.Linear (LoRA, tensor parallel) is not packed: its adapter's
    contribution is kept. The others are. The adapter's product is an fp32 MKL matmul, whose summation order
    follows the operands' memory alignment, so two forwards of it may differ in the last fp32 bits, which the
    bf16 cast of q turns into at most one bf16 ulp (2^-8 relative) of q: the logits then move by a few ulps of
    their own size (bound: 2^-5 of the largest |logit|). Without the adapter they move far more (the check)."""
    attn = model.decoder_layers()[0].self_attn
    lora = LoRALinear.wrap(attn.q_proj, LoraSpec(4, 8.0, 0.0, ("q_proj",)), seed=0)
    with torch.no_grad():
        lora.lora_B.normal_(0, 0.5)  # a trained adapter (B starts at zero)
    assert isinstance(attn.q_proj, LoRALinear)
    ids = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(4))
    weights = PackedWeights(model, rows=4)
    with torch.no_grad():
        with weights.applied():
            assert attn.packed is None
            assert model.decoder_layers()[1].self_attn.packed is not None
            packed = model(ids).float()
        plain = model(ids).float()
        lora.lora_enabled = False
        without_adapter = model(ids).float()
    bound = 2.0**-5 * plain.abs().max()
    assert (packed - plain).abs().max() <= bound
    assert (without_adapter - plain).abs().max() > 4 * bound


def test_a_weight_sync_rebuilds_the_packs_of_the_engine_that_lives_on(model):
    """DockrlRollout.sync tells its engine (`weights_changed`): the next rollout decodes with the new weights,
    which the switch wrote into the buffers the parameters view (here: in place, the same storage)."""
    from types import SimpleNamespace

    from dockrl.engines.rollout.dockrl_rollout import DockrlRollout

    spec = SimpleNamespace(
        max_batch_size=4,
        max_seq_len=40,
        kv_cache="auto",
        kv_cache_tokens=0,
        env=None,
        pack_weights=True,
        native_kernels=True,
    )
    host = SimpleNamespace(model=model, pad_token_id=0, decode=None, vision=None)
    rollout = DockrlRollout(spec, host)

    def tokens() -> list[int]:
        engine = rollout.engine()
        engine.add(Request(list(range(5, 12)), [3], SamplingParams(max_new_tokens=10, temperature=0.0)))
        return list(next(iter(engine.run())).generation.token_ids)

    class Rewrite:  # the switch's part: new weights into the same buffers
        def in_place(self) -> int:
            with torch.no_grad():
                for layer in model.decoder_layers():
                    layer.mlp.down_proj.weight.data.mul_(-3.0)
            return 0

    before = tokens()
    rollout.sync(Rewrite())  # type: ignore[arg-type]
    after = tokens()
    fresh = RolloutEngine(model, num_slots=4, max_seq_len=40, pack_weights=False)
    fresh.add(Request(list(range(5, 12)), [3], SamplingParams(max_new_tokens=10, temperature=0.0)))
    assert after == list(next(iter(fresh.run())).generation.token_ids) != before
