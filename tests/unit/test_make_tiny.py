"""models/tiny.py: make_tiny is deterministic and writes a directory both dockrl and transformers load."""

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dockrl.models.hf import load_model
from dockrl.models.tiny import make_tiny
from dockrl.models.tokenizer import Tokenizer

SMALL = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)


def _hashes(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_seed_gives_identical_files(tmp_path):
    first = _hashes(make_tiny(tmp_path / "a", seed=7, **SMALL))
    second = _hashes(make_tiny(tmp_path / "b", seed=7, **SMALL))
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors", "config.json"} <= first.keys()
    assert first == second
    other_seed = _hashes(make_tiny(tmp_path / "c", seed=8, **SMALL))
    assert other_seed["tokenizer.json"] == first["tokenizer.json"]
    assert other_seed["model.safetensors"] != first["model.safetensors"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_loads_in_dockrl_and_transformers(family, tmp_path):
    out = make_tiny(tmp_path, family=family, **SMALL)
    tokenizer = Tokenizer.from_dir(out)
    model = load_model(out)
    args = model.args
    assert args.vocab_size == tokenizer.vocab_size == model.model.embed_tokens.weight.shape[0]
    assert args.eos_token_id == tokenizer.eos_token_id == tokenizer.encode("<|im_end|>")[0]
    assert args.pad_token_id == tokenizer.pad_token_id == tokenizer.encode("<|endoftext|>")[0]
    assert args.tie_word_embeddings == (family != "llama")
    assert args.qk_norm == (family == "qwen3")
    assert args.attention_bias == (family == "qwen2")
    assert args.rope_scaling is None

    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    assert hf_model.config.vocab_size == len(hf_tokenizer) == tokenizer.vocab_size
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12+34?"}])
    ids = torch.tensor([tokenizer.encode(prompt)])
    assert ids[0].tolist() == hf_tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        logits = model(ids)
        assert (hf_model(ids).logits - logits).abs().max().item() <= 1e-4
    assert logits.std().item() > 0  # random weights, not an all-zero model


def test_custom_corpus_and_vocab_target(tmp_path):
    corpus = ["abc abd abe " * 5, "12 + 34 = 46"] * 20
    out = make_tiny(tmp_path, corpus=corpus, vocab_size=300, **SMALL)
    tokenizer = Tokenizer.from_dir(out)
    config = json.loads((out / "config.json").read_text())
    assert 259 <= tokenizer.vocab_size <= 300
    assert config["vocab_size"] == tokenizer.vocab_size
    assert len(tokenizer.encode(" abc")) == 1  # the merge learned from this corpus
    with pytest.raises(ValueError, match="family='gpt2'"):
        make_tiny(tmp_path / "bad", family="gpt2")


def test_a_padded_vocabulary_and_an_eos_rate(tmp_path):
    """padded_vocab_size gives the head more rows than the tokenizer has tokens (ids past it decode to nothing);
    eos_rate makes a random model end a response with that probability per token (geometric lengths). The rate
    is solved from a ~uniform softmax over V - 1 other tokens and corrected once; the measured mean of a fresh
    draw lands within 10% of it (the other logits' spread, std ~0.02 x sqrt(hidden), moves it by a few percent)."""
    out = make_tiny(tmp_path, hidden_size=64, num_layers=2, padded_vocab_size=2048, eos_rate=0.02)
    tokenizer, model = Tokenizer.from_dir(out), load_model(out)
    args = model.args
    assert args.vocab_size == 2048 > tokenizer.vocab_size and not args.tie_word_embeddings
    assert tokenizer.decode([2000, 2047]) == ""
    ids = torch.randint(0, 2048, (8, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
        eos = torch.softmax(logits.float(), dim=-1)[..., args.eos_token_id]
        hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert (hf_model(ids).logits - logits).abs().max().item() <= 1e-4
    assert abs(eos.mean().item() - 0.02) <= 0.002
    with pytest.raises(ValueError, match="below the tokenizer's"):
        make_tiny(tmp_path / "small", padded_vocab_size=300, **SMALL)
    with pytest.raises(ValueError, match="eos_rate=1.5"):
        make_tiny(tmp_path / "rate", eos_rate=1.5, **SMALL)
