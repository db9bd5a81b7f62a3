"""LoRA on the decoder (dockrl.models.lora): exact base behaviour at init and with adapters off, frozen base,
merging, and PEFT's adapter format in both directions against peft + transformers.

Shape letters: B batch, T tokens, V vocabulary.
"""

import json

import pytest
import torch

from dockrl.models import ModelArgs, Transformer
from dockrl.models.hf import load_model, save_model
from dockrl.models.lora import (
    ADAPTER_CONFIG_FILE,
    LINEAR_NAMES,
    LoRALinear,
    LoraSpec,
    adapter_state,
    adapters_disabled,
    apply_lora,
    load_peft,
    lora_layers,
    merge_into,
    merge_lora,
    resolve_targets,
    save_peft,
)
from helpers import PARITY_BOUND

VOCAB = 128


def tiny_args(family: str = "qwen2") -> ModelArgs:
    return ModelArgs(
        family=family,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=64,
    )


def tiny_model(family: str = "qwen2", seed: int = 0) -> Transformer:
    model = Transformer(tiny_args(family))
    model.init_weights(seed=seed, std=0.2)
    return model.eval()


def randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    """Nonzero B (a fresh adapter has B = 0 and changes nothing), so the adapters show in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.copy_(0.3 * torch.randn(layer.lora_B.shape, generator=generator))


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=LINEAR_NAMES)


@torch.no_grad()
def test_fresh_adapters_and_adapters_off_compute_the_base_model_exactly():
    base = tiny_model()
    expected = base(IDS)  # [B, T, V]
    model = tiny_model()
    adapted = apply_lora(model, SPEC)
    assert len(adapted) == 2 * len(LINEAR_NAMES)
    assert torch.equal(model(IDS), expected)  # B = 0: x W^T + b + 0, bit for bit
    randomize_adapters(model, seed=1)
    changed = model(IDS)
    assert (changed - expected).abs().max().item() > 0.1
    with adapters_disabled(model):
        assert torch.equal(model(IDS), expected)  # the reference policy: the base, no second copy
    assert torch.equal(model(IDS), changed)


def test_only_adapters_train():
    model = tiny_model().train()
    apply_lora(model, LoraSpec(rank=2, alpha=4.0, dropout=0.0, target_modules=("q_proj", "down_proj")))
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"model.layers.{i}.{m}.lora_{f}"
        for i in range(2)
        for m in ("self_attn.q_proj", "mlp.down_proj")
        for f in "AB"
    )
    model(IDS).float().logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None) == param.requires_grad, name
    # B = 0 at init: A's gradient is zero, B's is not (the usual LoRA start).
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert layer.lora_A.grad.abs().max().item() == 0.0 and layer.lora_B.grad.abs().max().item() > 0


@torch.no_grad()
def test_merge_equals_the_adapted_model():
    """W + s B A, accumulated in fp32: the merged model's logits equal the adapted model's up to the rounding
    of one fp32 add per weight (|W| + |s B A| <= 2, so 2 eps_fp32 per weight element), carried through the
    network: bounded by the parity bound, far below the adapters' effect (> 0.1)."""
    model = tiny_model()
    apply_lora(model, SPEC)
    randomize_adapters(model, seed=2)
    adapted = model(IDS)
    state = adapter_state(model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}
    merge_lora(model)
    assert not list(lora_layers(model)) and not any("lora_" in n for n, _ in model.named_parameters())
    assert (model(IDS) - adapted).abs().max().item() < PARITY_BOUND
    for name, merged in model.named_parameters():
        assert torch.equal(merge_into(name, weights[name], state, SPEC.scaling), merged), name


def test_resolve_targets_names_the_linear_layers():
    assert resolve_targets("all-linear") == LINEAR_NAMES
    assert resolve_targets(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match=r"names \['qkv'\].*q_proj.*down_proj"):
        resolve_targets(["q_proj", "qkv"])
    with pytest.raises(ValueError, match="all-linear"):
        resolve_targets("everything")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@torch.no_grad()
def test_peft_loads_our_adapter_with_equal_logits(tmp_path, family):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = tiny_model(family)
    save_model(base, base.args, tmp_path / "base")
    model = load_model(tmp_path / "base").eval()
    apply_lora(model, SPEC)
    randomize_adapters(model, seed=4)
    ours = model(IDS)
    save_peft(model, tmp_path / "adapter", SPEC, str(tmp_path / "base"))
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())["r"] == SPEC.rank
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    expected = theirs(input_ids=IDS).logits
    assert (expected - ours).abs().max().item() < PARITY_BOUND
    with adapters_disabled(model):
        assert (expected - model(IDS)).abs().max().item() > 0.1  # the adapters matter in the comparison


@torch.no_grad()
def test_we_load_a_peft_adapter_with_equal_logits(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = tiny_model()
    save_model(base, base.args, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    config = peft.LoraConfig(r=3, lora_alpha=6, target_modules=["k_proj", "up_proj"], init_lora_weights=False)
    theirs = peft.get_peft_model(hf, config).eval()  # init_lora_weights=False: random B, not zero
    theirs.save_pretrained(tmp_path / "adapter")
    expected = theirs(input_ids=IDS).logits
    model = load_model(tmp_path / "base").eval()
    spec = load_peft(model, tmp_path / "adapter")
    assert spec.rank == 3 and spec.scaling == 2.0 and spec.target_modules == ("k_proj", "up_proj")
    assert all(isinstance(layer, LoRALinear) for _, layer in lora_layers(model))
    assert (expected - model(IDS)).abs().max().item() < PARITY_BOUND
    with adapters_disabled(model):
        assert (expected - model(IDS)).abs().max().item() > 1e-3  # the adapter is in the comparison


def _train_cfg(overrides: list[str]):
    from dockrl.config import TrainConfig
    from dockrl.config.loader import load_config

    required = ["model.path=/m", "data.train_path=/d.jsonl", "run.steps=1", "run.prompts_per_step=2"]
    return load_config(TrainConfig, None, [*required, *overrides])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor.lora.alpha=16"],
            r"actor.lora.rank=0: is full fine-tuning, so actor.lora.alpha would do nothing",
        ),
        (["actor.lora.rank=-1"], r"actor.lora.rank=-1: must be >= 0"),
        (["actor.lora.rank=8", "actor.lora.alpha=0"], r"actor.lora.alpha=0.0: must be > 0"),
        (["actor.lora.rank=8", "actor.lora.dropout=1.0"], r"actor.lora.dropout=1.0: must be in \[0, 1\)"),
        (
            ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj, attn]"],
            r"actor.lora.target_modules=\['q_proj', 'attn'\]: names \['attn'\]; the model's linear layers are "
            r"\['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'\]",
        ),
        (["actor.lora.rank=8", "algo.name=ppo"], r"actor.lora.rank=8: LoRA with a critic \(algo.name=ppo\)"),
        (
            ["actor.lora.rank=8", "model.ref_path=/r"],
            r"model.ref_path='/r': with actor.lora the KL reference",
        ),
    ],
)
def test_lora_settings_are_checked_by_name(overrides, message):
    from dockrl.config.validate import check_train
    from dockrl.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        check_train(_train_cfg(overrides))


def test_the_plan_carries_the_resolved_lora_settings():
    from dockrl.config.step_plan import step_plan

    assert step_plan(_train_cfg([])).lora is None
    plan = step_plan(_train_cfg(["actor.lora.rank=4", "actor.lora.target_modules=[v_proj, q_proj]"]))
    assert plan.lora is not None and plan.reference_is_base
    assert (plan.lora.rank, plan.lora.alpha, plan.lora.dropout) == (4, 8.0, 0.0)
    assert plan.lora.target_modules == ("q_proj", "v_proj")


def test_an_adapter_checkpoint_loads_only_onto_its_base(tmp_path):
    """A LoRA checkpoint holds the adapters and a pointer to the base (its weights' fingerprint): it loads into
    a LoRA engine on that base, and refuses another base of the same shape and a full fine-tuning engine."""
    from dockrl.checkpoint.sharded import engine_state, load_engine, save_engine
    from dockrl.config.schema import OptimConfig
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.hf import weights_fingerprint

    for seed in (0, 1):
        model = tiny_model(seed=seed)
        save_model(model, model.args, tmp_path / f"base{seed}")
    assert weights_fingerprint(tmp_path / "base0") != weights_fingerprint(tmp_path / "base1")

    def engine(base: str, lora: LoraSpec | None = SPEC) -> TrainEngine:
        return TrainEngine(
            str(tmp_path / base), device="cpu", precision="fp32", optim=OptimConfig(), lora=lora
        )

    trained = engine("base0")
    randomize_adapters(trained.model, seed=6)
    state = engine_state(trained)
    # No optimizer step yet: no AdamW moments, only the group settings and the LR schedule.
    assert {k.split("/")[0] for k in state} == {"model", "lora_base", "optim_groups", "scheduler"}
    assert all(".lora_" in k for k in state if k.startswith("model/"))
    save_engine(trained, tmp_path / "ckpt")
    again = engine("base0")
    load_engine(again, tmp_path / "ckpt")
    loaded, saved = adapter_state(again.model), adapter_state(trained.model)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    with pytest.raises(ValueError, match="fingerprints differ"):
        load_engine(engine("base1"), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="holds LoRA adapters only"):
        load_engine(engine("base0", lora=None), tmp_path / "ckpt")


def test_peft_per_module_settings_are_refused_by_name(tmp_path):
    """An adapter whose alpha_pattern gives q_proj 8.0 where lora_alpha says 2.0 (as PEFT applies it) is refused,
    never loaded at the wrong scale; so are rank_pattern, layers_to_transform and exclude_modules."""
    from dockrl.models.lora import read_peft_spec

    base = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 2,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(base))
    assert read_peft_spec(tmp_path).scaling == 0.5
    for key, value in [
        ("alpha_pattern", {"q_proj": 8}),
        ("rank_pattern", {"v_proj": 2}),
        ("layers_to_transform", [0]),
        ("exclude_modules", ["v_proj"]),
    ]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**base, key: value}))
        with pytest.raises(ValueError, match=rf"sets {{'{key}': .*which dockrl does not read"):
            read_peft_spec(tmp_path)
    # PEFT writes empty ones by default: those are fine
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({**base, "alpha_pattern": {}, "rank_pattern": {}})
    )
    assert read_peft_spec(tmp_path).rank == 4


def test_a_merge_into_fp32_keeps_the_update_a_bf16_base_would_round_away():
    """A small update (1e-4 of a weight of 1) on a bf16 base: merged into fp32 it is all there; cast to bf16
    first (eps 2^-7 = 0.0078) it is gone, as the export lost it before."""
    from dockrl.models.lora import merge_into

    weight = torch.ones(2, 2, dtype=torch.bfloat16)
    adapters = {"m.lora_A": torch.full((1, 2), 1e-2), "m.lora_B": torch.full((2, 1), 1e-2)}
    merged = merge_into("m.weight", weight, adapters, 1.0, dtype=torch.float32)
    assert merged.dtype == torch.float32 and torch.allclose(merged, torch.full((2, 2), 1.0001))
    assert torch.equal(merge_into("m.weight", weight, adapters, 1.0).float(), torch.ones(2, 2))


def test_a_peft_adapters_dropout_is_not_taken_over(tmp_path):
    from dockrl.config.resolve import copy_with
    from dockrl.recipes.preflight import _lora_adapter

    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.05,
        "target_modules": ["q_proj"],
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    cfg = _train_cfg([])
    with pytest.warns(UserWarning, match=r"lora_dropout=0.05 is not applied"):
        found = _lora_adapter(cfg, str(tmp_path))
    assert "actor.lora.dropout" not in found and found["actor.lora.alpha"] == 8.0
    assert copy_with(cfg, found).actor.lora.dropout is None  # 0 in the run: the same in every pass


def test_the_kl_reference_of_a_starting_adapter_is_that_adapter_or_the_base(tmp_path):
    """model.lora_path: the engine keeps the adapters it loaded; inside `starting_adapters()` its log-probs are
    those of base + that adapter (algo.kl_reference=adapter), inside `adapters_off()` the base's (=base), and
    the trained adapters come back bit for bit. Both are another process's forward of the same fp32 weights:
    1e-5 per token (the rollout-trainer bound). The trained policy lies far outside it, so the check sees
    which reference is computed."""
    from dockrl.algos.logprobs import token_logprobs
    from dockrl.config.schema import OptimConfig
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.lora import read_peft_adapters

    base = tiny_model()
    save_model(base, base.args, tmp_path / "base")
    started = tiny_model()
    apply_lora(started, SPEC)
    randomize_adapters(started, seed=4)  # an SFT's adapter: B != 0
    save_peft(started, tmp_path / "adapter", SPEC, str(tmp_path / "base"))
    engine = TrainEngine(
        str(tmp_path / "base"),
        device="cpu",
        precision="fp32",
        optim=OptimConfig(),
        lora=SPEC,
        lora_init=read_peft_adapters(tmp_path / "adapter"),
        keep_starting_adapters=True,
    )
    randomize_adapters(engine.model, seed=5)  # what training made of them
    trained = {k: v.clone() for k, v in adapter_state(engine.model).items()}
    prompts, responses = [IDS[0, :4], IDS[1, :3]], [IDS[0, 4:], IDS[1, 3:]]

    def engine_logprobs() -> torch.Tensor:
        got, _ = engine.logprobs(prompts, responses, temperature=1.0, micro_batch_size=2, pad_token_id=0)
        return torch.cat(got)

    def model_logprobs(model: Transformer) -> torch.Tensor:
        with torch.no_grad():
            rows = [
                token_logprobs(model(torch.cat([p, r])[None])[0, len(p) - 1 : -1], r)
                for p, r in zip(prompts, responses)
            ]
        return torch.cat(rows)

    with engine.starting_adapters():
        reference = engine_logprobs()
    with engine.adapters_off():
        base_reference = engine_logprobs()
    policy = engine_logprobs()
    after = adapter_state(engine.model)
    assert all(torch.equal(after[k], trained[k]) for k in trained)  # the trained values, bit for bit
    bound = 1e-5
    assert (reference - model_logprobs(started)).abs().max() < bound
    assert (base_reference - model_logprobs(base)).abs().max() < bound
    assert (policy - model_logprobs(started)).abs().max() > 100 * bound  # the trained adapters differ
    assert (reference - base_reference).abs().max() > 100 * bound  # the two references differ
