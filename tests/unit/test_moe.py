"""Qwen3-MoE in dockrl's decoder: transformers' numbers, its checkpoints in and out (per-expert files, fused
parameters), grouped experts, routing record and replay, the load-balancing loss."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from dockrl.models.config import ModelArgs
from dockrl.models.decoder import Transformer
from dockrl.models.hf import CheckpointReader, load_model, load_state_dict, read_config, save_model
from dockrl.models.moe import Experts, MoEBlock, Routing, load_balancing_loss, moe_blocks, routing
from helpers import perturb_

VOCAB, SEQ, EXPERTS, TOP_K = 96, 24, 8, 2
FP32_EPS = torch.finfo(torch.float32).eps


def _hf_model(*, mlp_only_layers=(), sparse_step=1) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    perturb_(model, seed=1)  # routers away from zero: tokens spread over experts
    return model.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _logit_bound(logits: torch.Tensor, args: ModelArgs) -> float:
    """Two fp32 implementations of the same arithmetic in a different order (grouped vs per-expert matmuls, SDPA
    vs eager attention): each dot product of K <= max(H, I) terms rounds to ~sqrt(K) x eps relative, over the
    layers plus the head."""
    width = max(args.hidden_size, args.intermediate_size, args.moe_intermediate_size)
    return (args.num_layers + 1) * width**0.5 * FP32_EPS * float(logits.abs().max()) * 4


@pytest.mark.parametrize("layout", [dict(), dict(mlp_only_layers=(0,)), dict(sparse_step=2)])
def test_transformers_checkpoint_loads_with_its_logits(tmp_path, layout):
    hf = _hf_model(**layout)
    hf.save_pretrained(tmp_path)
    names = set(CheckpointReader(tmp_path).files)
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)  # per-expert tensors on disk
    model = load_model(tmp_path).eval()
    args = model.args
    assert args.family == "qwen3_moe" and args.num_experts == EXPERTS and args.num_experts_per_tok == TOP_K
    assert [isinstance(layer.mlp, MoEBlock) for layer in model.decoder_layers()] == [
        args.is_moe_layer(i) for i in range(3)
    ]
    with torch.no_grad():
        ours, theirs = model(_ids()), hf(_ids()).logits
    assert (ours - theirs).abs().max() <= _logit_bound(theirs, args)


def test_dockrl_checkpoint_loads_in_transformers(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    perturb_(model, seed=5)  # weights of dockrl's own, written by dockrl
    save_model(model, model.args, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == EXPERTS
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back) is Qwen3MoeForCausalLM
    with torch.no_grad():
        ours, theirs = model(_ids()), back(_ids()).logits
    assert (ours - theirs).abs().max() <= _logit_bound(theirs, model.args)
    reloaded = load_state_dict(tmp_path / "out")  # fused again, bit for bit
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded[name], tensor), name


def test_reader_slices_fused_experts(tmp_path):
    _hf_model().save_pretrained(tmp_path)
    reader = CheckpointReader(tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    full = reader.read(name)
    assert reader.shapes[name] == tuple(full.shape) == (EXPERTS, 32, 32)
    assert torch.equal(reader.read(name, (slice(2, 5),)), full[2:5])
    assert torch.equal(reader.read(name, (slice(6, 8), slice(0, 16))), full[6:8, :16])  # gate rows only


def test_make_tiny_qwen3_moe(tmp_path):
    from dockrl.models.tiny import make_tiny

    path = make_tiny(tmp_path / "m", family="qwen3_moe", hidden_size=32, num_heads=2, num_kv_heads=1)
    args = read_config(path)
    assert args.num_experts == 8 and args.num_experts_per_tok == 2 and args.moe_layers == [0, 1]
    model = load_model(path)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()


def _per_token_reference(experts: Experts, x, chosen, weights):
    """The definition, one token and one slot at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_grouped_experts_equal_the_per_token_definition():
    args = read_args()
    experts = Experts(args)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * 0.2)
    x = torch.randn(40, 32, generator=generator)
    chosen = torch.randint(0, EXPERTS, (40, TOP_K), generator=generator)
    chosen[:, 1] = (chosen[:, 0] + 1) % EXPERTS  # distinct experts per token, as top-k gives
    chosen[:5] = 3  # an expert with many tokens; some experts get none
    chosen[:5, 1] = 4
    weights = torch.rand(40, TOP_K, generator=generator)
    with torch.no_grad():
        got, want = experts(x, chosen, weights), _per_token_reference(experts, x, chosen, weights)
    # different summation order only: each output sums 2 x I products of magnitude <= max|w x h|
    assert (got - want).abs().max() <= 64 * FP32_EPS * float(want.abs().max())


def read_args() -> ModelArgs:
    return ModelArgs(
        family="qwen3_moe",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=16,
        tie_word_embeddings=True,
    )


def _moe_model() -> Transformer:
    model = Transformer(read_args())
    model.init_weights(seed=0)
    perturb_(model, seed=2)
    return model.eval()


def test_routing_records_and_replays():
    model = _moe_model()
    ids = _ids()
    with torch.no_grad(), routing(model, Routing(record=True)) as seen:
        plain = model(ids)
    assert sorted(seen.recorded) == [0, 1] and seen.recorded[0].shape == (2, SEQ, TOP_K)
    # replaying the model's own routes changes nothing
    with torch.no_grad(), routing(model, Routing(replay=seen.recorded)):
        replayed = model(ids)
    assert torch.equal(plain, replayed)
    # other experts: other logits, and the replayed experts are the ones used
    other = {layer: (top + 1) % EXPERTS for layer, top in seen.recorded.items()}
    with torch.no_grad(), routing(model, Routing(replay=other, record=True)) as forced:
        moved = model(ids)
    assert torch.equal(forced.recorded[0], other[0]) and torch.equal(forced.routed[0], seen.recorded[0])
    assert (moved - plain).abs().max() > 1e-3
    assert all(block.routing is None for block in moe_blocks(model))  # the context leaves no state


def test_replayed_routes_still_train_the_router():
    model = _moe_model().train()
    with torch.no_grad(), routing(model, Routing(record=True)) as seen:
        model(_ids())
    with routing(model, Routing(replay=seen.recorded)):
        model(_ids()).float().logsumexp(-1).mean().backward()
    assert all(float(b.gate.weight.grad.abs().sum()) > 0 for b in moe_blocks(model))


def test_load_balancing_loss_is_transformers():
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(30, EXPERTS, generator=generator) for _ in range(3)]
    ours = load_balancing_loss(logits, TOP_K, EXPERTS)
    theirs = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    assert float(load_balancing_loss([torch.zeros(30, EXPERTS)], TOP_K, EXPERTS)) == pytest.approx(TOP_K)


def test_moe_config_errors():
    with pytest.raises(ValueError, match="experts come with family='qwen3_moe'"):
        ModelArgs(**{**read_args().to_dict(), "family": "qwen3", "num_experts": 8})
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        ModelArgs(**{**read_args().to_dict(), "num_experts_per_tok": 9})


def _rollout(model, prompts, new_tokens=6):
    from dockrl.engines.rollout.rollout_engine import Request, RolloutEngine
    from dockrl.engines.rollout.sampling import SamplingParams

    engine = RolloutEngine(model, num_slots=3, max_seq_len=64, record_routes=True)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    for i, prompt in enumerate(prompts):
        engine.add(Request(prompt, [i, i + 10], params, tag=i))  # two samples share each prefill
    return {(c.tag, c.sample): (prompts[c.tag], c.generation) for c in engine.run()}


def _teacher_forced(model, prompt, tokens):
    """Routes and log-probs of prompt + tokens in one forward, with each MoE layer's top-k margin (k-th minus
    (k+1)-th router probability) per position."""
    ids = torch.tensor(prompt + tokens)[None]
    margins = {}

    def keep(block):
        def hook(module, args, output):
            probs = torch.softmax(output.float(), dim=-1).sort(dim=-1, descending=True).values
            margins[block.layer] = probs[:, TOP_K - 1] - probs[:, TOP_K]

        return block.gate.register_forward_hook(hook)

    handles = [keep(block) for block in moe_blocks(model)]
    with torch.no_grad(), routing(model, Routing(record=True)) as seen:
        logits = model(ids)[0].float()
    for handle in handles:
        handle.remove()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(tokens)[:, None])[
        :, 0
    ]
    return seen, margins, logprobs


def test_rollout_records_the_routes_of_every_fed_token():
    model = _moe_model()
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    checked = 0
    for (tag, _), (prompt, gen) in _rollout(model, prompts).items():
        tokens = gen.token_ids.tolist()
        assert gen.routes.dtype == torch.int16 and gen.routes.shape == (
            len(prompt) + len(tokens) - 1,
            2,
            TOP_K,
        )
        seen, margins, _ = _teacher_forced(model, prompt, tokens)
        for j, layer in enumerate(model.args.moe_layers):
            ours = gen.routes[:, j].long().sort(dim=-1).values
            full = seen.recorded[layer][0, :-1].sort(dim=-1).values  # the last token is never fed
            clear = margins[layer][:-1] > 1e-4  # cached decode vs one forward: fp32 rounding, ~1e-7
            assert torch.equal(ours[clear], full[clear]), (tag, layer)
            checked += int(clear.sum())
    assert checked > 0.9 * sum(len(p) + 5 for p in prompts) * 2 * 2  # nearly every position is clear


def test_replay_gives_the_rollouts_log_probs_where_routers_disagree():
    """A trainer whose router differs a little from the rollout's (as different kernels' rounding makes it):
    with the rollout's routes replayed its log-probs stay within the perturbation's reach of the rollout's;
    routing on its own, the tokens whose experts flipped move much further."""
    rollout_model = _moe_model()
    trainer = _moe_model()
    eps = 2e-2
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for block in moe_blocks(trainer):
            block.gate.weight.mul_(1 + eps * torch.randn(block.gate.weight.shape, generator=generator))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    replayed_gap, own_gap, flipped = 0.0, 0.0, 0
    for (_, _), (prompt, gen) in _rollout(rollout_model, prompts, new_tokens=8).items():
        tokens = gen.token_ids.tolist()
        replay = {
            layer: torch.cat([gen.routes[:, j].long(), torch.arange(TOP_K)[None]])[None]
            for j, layer in enumerate(rollout_model.args.moe_layers)
        }
        ids = torch.tensor(prompt + tokens)[None]
        with torch.no_grad(), routing(trainer, Routing(replay=replay, record=True)) as seen:
            logits = trainer(ids)[0].float()
        lp_replay = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(
            -1, torch.tensor(tokens)[:, None]
        )
        _, _, lp_own = _teacher_forced(trainer, prompt, tokens)
        replayed_gap = max(replayed_gap, float((lp_replay[:, 0] - gen.logprobs).abs().max()))
        own_gap = max(own_gap, float((lp_own - gen.logprobs).abs().max()))
        flipped += sum(
            int(
                (seen.routed[layer][0, :-1].sort(-1).values != seen.recorded[layer][0, :-1].sort(-1).values)
                .any(-1)
                .sum()
            )
            for layer in rollout_model.args.moe_layers
        )
    assert flipped > 0  # the perturbation did change some routes
    # replayed: only the gate weights of the same experts moved, by ~eps relative: the gap stays of order eps
    assert replayed_gap < 2 * eps
    assert own_gap > 2 * replayed_gap  # routing on its own, the flipped experts dominate
