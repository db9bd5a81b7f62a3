"""models/hf.py: Hugging Face checkpoint directories load and save with logits identical to transformers."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dockrl.models.config import ModelArgs
from dockrl.models.decoder import Transformer
from dockrl.models.hf import load_model, load_state_dict, read_config, save_model
from helpers import perturb_

VOCAB = 96
SEQ = 40
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that positions up to SEQ fall in every band of the llama3 frequency rescaling.
    "original_max_position_embeddings": 16,
}
_HF_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def _hf_model(family: str, *, tie: bool, rope_scaling: dict | None = None) -> torch.nn.Module:
    config_cls, model_cls = _HF_CLASSES[family]
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 16  # != hidden / heads, as in real Qwen3 checkpoints
    if family == "llama":
        kwargs["attention_bias"] = True
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs))
    perturb_(model, seed=1)
    return model.eval()


def _dockrl_args(family: str, *, tie: bool, rope_scaling: dict | None = None) -> ModelArgs:
    return ModelArgs(
        family=family,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16 if family == "qwen3" else 8,
        rope_scaling=rope_scaling,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attention_bias=family != "qwen3",
        qk_norm=family == "qwen3",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _dockrl_model(args: ModelArgs) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=0)
    perturb_(model, seed=2)
    return model.eval()


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _max_logit_diff(hf_model: torch.nn.Module, dockrl_model: Transformer) -> float:
    ids = _input_ids()
    return (hf_model(ids).logits - dockrl_model(ids)).abs().max().item()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_load_hf_checkpoint_matches_transformers_logits(family, tmp_path):
    hf_model = _hf_model(family, tie=family == "qwen3")
    hf_model.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.args.family == family
    assert _max_logit_diff(hf_model, model) <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_saved_model_loads_in_transformers_with_same_logits(family, tmp_path):
    args = _dockrl_args(family, tie=family == "qwen2")
    model = _dockrl_model(args)
    save_model(model, args, tmp_path)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf_model) is _HF_CLASSES[family][1]
    assert _max_logit_diff(hf_model, model) <= 1e-4
    generation_config = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_sharded_save_loads_back_bitwise(tmp_path):
    args = _dockrl_args("llama", tie=False)
    model = _dockrl_model(args)
    save_model(model, args, tmp_path, max_shard_bytes=16 * 1024)
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    original = model.state_dict()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())
    loaded = load_state_dict(tmp_path)
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name
    reloaded = load_model(tmp_path)
    ids = _input_ids()
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))
        hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        assert (hf_model(ids).logits - model(ids)).abs().max().item() <= 1e-4
    # Saving again unsharded replaces the shards instead of leaving them beside the single file.
    save_model(model, args, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_tied_embeddings_round_trip(tmp_path):
    args = _dockrl_args("qwen2", tie=True)
    model = _dockrl_model(args)
    save_model(model, args, tmp_path / "a")
    stored = load_file(tmp_path / "a" / "model.safetensors")
    assert "lm_head.weight" not in stored  # written once, as model.embed_tokens.weight
    reloaded = load_model(tmp_path / "a")
    assert reloaded.output_weight() is reloaded.model.embed_tokens.weight
    assert torch.equal(reloaded.output_weight(), model.model.embed_tokens.weight)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    assert torch.equal(hf_model.lm_head.weight, model.model.embed_tokens.weight)

    # A tied checkpoint that also stores lm_head.weight (as some exporters do) loads with it dropped.
    stored["lm_head.weight"] = torch.zeros_like(stored["model.embed_tokens.weight"])
    save_file(stored, tmp_path / "a" / "model.safetensors", metadata={"format": "pt"})
    reloaded = load_model(tmp_path / "a")
    assert torch.equal(reloaded.output_weight(), model.model.embed_tokens.weight)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    hf_model = _hf_model("llama", tie=False, rope_scaling=LLAMA3_ROPE)
    hf_model.save_pretrained(tmp_path / "scaled")
    model = load_model(tmp_path / "scaled")
    assert model.args.rope_scaling["rope_type"] == "llama3"
    assert _max_logit_diff(hf_model, model) <= 1e-4
    # The comparison is sensitive to the scaling: the same weights with plain RoPE give other logits.
    unscaled = _hf_model("llama", tie=False)
    unscaled.save_pretrained(tmp_path / "plain")
    assert _max_logit_diff(hf_model, load_model(tmp_path / "plain")) > 1e-2
    # And dockrl's save writes the scaling back so transformers rebuilds the same rope.
    save_model(model, model.args, tmp_path / "resaved")
    resaved = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", dtype=torch.float32).eval()
    assert _max_logit_diff(resaved, model) <= 1e-4


def test_load_casts_to_dtype_and_save_records_dtype(tmp_path):
    args = _dockrl_args("qwen3", tie=True)
    model = _dockrl_model(args)
    save_model(model, args, tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_state_dict(tmp_path).values())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = load_model(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in reloaded.parameters())
    expected = model.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(reloaded.model.embed_tokens.weight, expected)
    assert not any(p.is_meta for p in reloaded.parameters())


def test_missing_model_dir_error_names_the_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing)) + ".*config.json"):
        load_model(missing)
    missing.mkdir()
    with pytest.raises(
        FileNotFoundError, match="no config.json in model directory " + re.escape(str(missing))
    ):
        read_config(missing)


def test_checkpoint_key_mismatch_is_a_value_error_listing_keys(tmp_path):
    args = _dockrl_args("llama", tie=False)
    state_dict = _dockrl_model(args).state_dict()
    del state_dict["model.layers.1.mlp.up_proj.weight"]
    state_dict["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_model(state_dict, args, tmp_path)
    with pytest.raises(
        ValueError, match=r"1 missing.*mlp\.up_proj\.weight.*1 unexpected.*self_attn\.extra\.weight"
    ):
        load_model(tmp_path)


@pytest.mark.parametrize("tie", [False, True])
def test_export_writes_a_directory_transformers_loads(tmp_path, tie):
    """dockrl export: every tensor streamed from the source to OUT (cast with --dtype), config recording the
    dtype written, tokenizer copied; transformers loads both exports and the fp32 one gives dockrl's logits."""
    from dockrl.cli import main
    from dockrl.models.tiny import make_tiny

    source = make_tiny(tmp_path / "src", family="qwen2", hidden_size=32, num_layers=2, seed=0)
    if tie:  # a tied model: no lm_head tensor in the files
        args = read_config(source)
        args.tie_word_embeddings = True
        model = _dockrl_model(args)
        save_model(model, args, source, tokenizer_dir=source)
    assert main(["export", str(source), str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    assert main(["export", str(source), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    original = load_state_dict(source)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        exported = load_state_dict(tmp_path / name)
        assert exported.keys() == original.keys()
        assert all(torch.equal(exported[k], original[k].to(dtype)) for k in original)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["dtype"] == str(dtype).removeprefix("torch.")
        assert (tmp_path / name / "tokenizer.json").is_file()
        hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert next(hf_model.parameters()).dtype == dtype
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    assert _max_logit_diff(hf_model, load_model(source)) <= 1e-4


def test_export_names_what_it_needs(tmp_path, capsys):
    from dockrl.cli import main

    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "holds no model: expected a checkpoint root" in capsys.readouterr().err
