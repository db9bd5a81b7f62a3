"""models/families/: every family file is registered, its record round-trips a Hugging Face config.json,
make-tiny builds it (causal LM and, where it has one, reward model), and the records' facts are the
decoder's."""

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from torch import nn

from dockrl.envs.tool_calls import PARSERS, parse_tool_calls
from dockrl.models.config import ModelArgs, VisionArgs
from dockrl.models.decoder import Transformer
from dockrl.models.families import (
    FAMILIES,
    LINEAR_NAMES,
    Family,
    ToolCallFormat,
    family_named,
    family_of,
    register,
)
from dockrl.models.hf import load_model, read_config
from dockrl.models.lora import LoraSpec, apply_lora, lora_layers
from dockrl.models.tiny import make_tiny

FAMILY_DIR = Path(__file__).resolve().parents[2] / "src" / "dockrl" / "models" / "families"
NOT_FAMILIES = {"__init__", "record"}
SMALL = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=300)


def _args(family: Family, **overrides) -> ModelArgs:
    """Two layers, the first dense, so an MoE family has both kinds of MLP."""
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,))
    vision = dict(
        vision=VisionArgs(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32),
        mrope_section=(1, 1, 2),
        vision_token_ids={"image": 60, "video": 61, "vision_start": 62, "vision_end": 63},
    )
    fields = dict(
        family=family.name,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        **(experts if family.moe else {}),
        **(vision if family.vision else {}),
    )
    return ModelArgs(**(fields | overrides))


def test_every_family_file_is_registered_by_the_package_and_imports_no_torch():
    """A fresh interpreter imports only the package: a family file missing from its import line is missing
    here, whatever this test process has imported."""
    probe = (
        "import json, sys\n"
        "from dockrl.models.families import FAMILIES\n"
        "print(json.dumps([list(FAMILIES), [m for m in ('torch', 'ray') if m in sys.modules]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    registered, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    files = sorted(p.stem for p in FAMILY_DIR.glob("*.py") if p.stem not in NOT_FAMILIES)
    assert sorted(registered) == files and heavy == []
    for name in files:  # each file's record is the one registered under the file's name
        assert importlib.import_module(f"dockrl.models.families.{name}").FAMILY is FAMILIES[name]


def test_register_refuses_a_taken_name_or_model_type():
    before = dict(FAMILIES)
    llama = FAMILIES["llama"]
    with pytest.raises(ValueError, match="already registered"):
        register(llama)
    with pytest.raises(ValueError, match=r"\['mistral'\] are already registered"):
        register(dataclasses.replace(llama, name="llama9", hf_model_types=("llama9", "mistral")))
    with pytest.raises(ValueError, match="must start with its name"):
        register(dataclasses.replace(llama, name="llama9", hf_model_types=("llama10",)))
    assert dict(FAMILIES) == before


@pytest.mark.parametrize("name", list(FAMILIES))
def test_record_round_trips_its_hf_config(name):
    family = FAMILIES[name]
    args = _args(family)
    cfg = args.to_hf_config()
    assert cfg["architectures"] == [family.causal_lm] and cfg["model_type"] == family.name
    assert {key: cfg[key] for key in family.hf_fixed} == dict(family.hf_fixed)
    assert family_of(cfg) is family_named(name) is family
    assert ModelArgs.from_hf_config(cfg) == args
    for model_type in family.hf_model_types:
        assert family_of({"model_type": model_type}) is family
        assert ModelArgs.from_hf_config(cfg | {"model_type": model_type}) == args
    if family.qkv_bias:  # Hugging Face hard-codes the bias: config.json's attention_bias is not read
        assert ModelArgs.from_hf_config(cfg | {"attention_bias": False}).attention_bias
        with pytest.raises(ValueError, match="attention_bias=True"):
            _args(family, attention_bias=False)
    with pytest.raises(ValueError, match="qk_norm"):
        _args(family, qk_norm=not family.qk_norm)
    if family.sliding_window_key is not None:
        with pytest.raises(ValueError, match=family.sliding_window_key):
            ModelArgs.from_hf_config(cfg | {family.sliding_window_key: 4096})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_names_the_records_classes(name):
    transformers = pytest.importorskip("transformers")
    family = FAMILIES[name]
    config = transformers.AutoConfig.for_model(**_args(family).to_hf_config())
    assert ModelArgs.from_hf_config(config.to_dict()) == _args(family)
    for class_name in (family.causal_lm, family.seq_cls):
        assert class_name is None or isinstance(getattr(transformers, class_name), type)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_make_tiny_builds_each_family(name, tmp_path):
    family = FAMILIES[name]
    out = make_tiny(tmp_path / "lm", family=name, **SMALL)
    args = load_model(out).args
    assert (args.family, args.qk_norm, args.is_moe) == (name, family.qk_norm, family.moe)
    assert (args.tie_word_embeddings, args.attention_bias) == (
        family.tiny.tie_word_embeddings,
        family.tiny.attention_bias,
    )
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [family.causal_lm]
    if family.seq_cls is None:
        with pytest.raises(ValueError, match="no sequence-classification model"):
            make_tiny(tmp_path / "rm", family=name, reward_model=True, **SMALL)
        return
    scorer = make_tiny(tmp_path / "rm", family=name, reward_model=True, **SMALL)
    assert json.loads((scorer / "config.json").read_text())["architectures"] == [family.seq_cls]
    assert read_config(scorer) == args


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_linear_names_are_the_decoders_linear_layers(name):
    """The names a record lists are exactly the decoder's linear layers apart from the LM head and routers,
    and LoRA adapts one of each."""
    family = FAMILIES[name]
    with torch.device("meta"):
        model = Transformer(_args(family))
    linears = {
        module_name.rpartition(".")[2]
        for module_name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module_name != "lm_head"
        and not module_name.endswith("mlp.gate")
        and not module_name.startswith("visual.")  # a vision tower's linears take no adapters
    }
    assert linears == set(family.linear_names)
    with torch.device("meta"):
        apply_lora(model, LoraSpec(rank=2, alpha=4.0, dropout=0.0, target_modules=family.linear_names))
    assert {layer_name.rpartition(".")[2] for layer_name, _ in lora_layers(model)} == set(family.linear_names)
    assert set(family.linear_names) <= set(LINEAR_NAMES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tool_call_format_has_a_parser(name):
    family = FAMILIES[name]
    assert set(PARSERS) == set(get_args(ToolCallFormat))
    if family.tool_call_format is None:
        with pytest.raises(ValueError, match=f"no tool-call format for model family '{name}'"):
            parse_tool_calls("text", name)
    else:
        assert parse_tool_calls("no call here", name).calls == []
