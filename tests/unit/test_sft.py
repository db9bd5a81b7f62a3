"""`dockrl sft`: every data setting it accepts is used (file order, prompt-length filter, held-out loss) and the
RL-only settings are refused by name. Expected values are computed here, one example at a time, from the
model on disk (no padding, no micro-batching), so they check the recipe's batching and masking too."""

import json
from pathlib import Path

import pytest
import torch

from dockrl.config import ConfigError, SFTConfig, load_config
from dockrl.data.datasets import load_prompts, render_prompt
from dockrl.models.hf import load_model
from dockrl.models.tokenizer import Tokenizer
from dockrl.recipes.preflight import preflight_sft
from dockrl.recipes.sft import sft

# fp32 sums of ~10^3 log-probs in another order: relative error ~1e-7 x sqrt(terms); 1e-5 leaves 100x margin.
REL = 1e-5


def _config(tiny_model, arithmetic_data, tmp_path, *overrides):
    base = [
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        "data.label_field=answer",
        "data.use_chat_template=false",
        "run.epochs=0.25",
        "run.batch_size=16",
        "run.device=cpu",
        "run.precision=fp32",
        "run.progress=false",
        f"run.output_dir={tmp_path}",
        "run.name=sft",
        "actor.micro_batch_size=5",  # uneven micro-batches: padding and the per-batch normaliser are exercised
    ]
    return preflight_sft(load_config(SFTConfig, None, base + list(overrides)))


def _examples(model_dir, path, limit=None):
    tok = Tokenizer.from_dir(model_dir)
    rows = load_prompts(str(path), prompt_field="prompt", label_field="answer", limit=limit)
    out = []
    for rec in rows:
        prompt = tok.encode(render_prompt(rec, tok, system_prompt=None, use_chat_template=False))
        out.append((prompt, tok.encode(str(rec.label)) + [tok.eos_token_id]))
    return out


@torch.no_grad()
def _nll_and_hits(model_dir, examples):
    """Summed answer-token NLL, argmax hits and token count, one unpadded example at a time."""
    model = load_model(model_dir).eval()
    nll = hits = tokens = 0.0
    for prompt, answer in examples:
        ids = torch.tensor([prompt + answer])
        logp = torch.log_softmax(model(ids)[0, :-1].float(), dim=-1)
        positions = range(len(prompt) - 1, len(prompt) + len(answer) - 1)
        for pos, token in zip(positions, answer):
            nll -= logp[pos, token].item()
            hits += float(logp[pos].argmax().item() == token)
        tokens += len(answer)
    return nll, hits, tokens


def test_sft_file_order_and_held_out_loss(tiny_model, arithmetic_data, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _config(
        tiny_model,
        arithmetic_data,
        tmp_path,
        "data.shuffle=false",
        f"data.eval_path={arithmetic_data['test']}",
        "data.eval_limit=12",
        "run.loggers=[jsonl, mlflow]",
    )
    summary = sft(cfg)
    metrics = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert summary["steps"] == 4 and len(metrics) == 4  # 256 examples / 16 x 0.25 epochs
    # run.loggers=[jsonl, mlflow]: the same losses by step in the MLflow run beside the run directory.
    store = MlflowClient(tracking_uri=f"sqlite:///{Path(summary['run_dir']).parent / 'mlflow.db'}")
    run_id = json.loads((Path(summary["run_dir"]) / "loggers.json").read_text())["mlflow"]
    history = sorted((m.step, m.value) for m in store.get_metric_history(run_id, "sft/loss"))
    assert history == [(row["step"], pytest.approx(row["sft/loss"])) for row in metrics]

    # data.shuffle=false: step 1 trains on the file's first 16 examples, under the untrained model.
    nll, hits, tokens = _nll_and_hits(tiny_model, _examples(tiny_model, arithmetic_data["train"])[:16])
    assert metrics[0]["sft/loss"] == pytest.approx(nll / tokens, rel=REL)
    assert metrics[0]["sft/token_accuracy"] == pytest.approx(hits / tokens, rel=REL)

    # data.eval_path / eval_limit: teacher-forced loss of the final model on the first 12 held-out examples.
    held_out = _examples(tiny_model, arithmetic_data["test"], limit=12)
    nll, hits, tokens = _nll_and_hits(summary["checkpoint"], held_out)
    assert summary["eval_examples"] == 12
    assert summary["eval/loss"] == pytest.approx(nll / tokens, rel=REL)
    assert summary["eval/token_accuracy"] == pytest.approx(hits / tokens, rel=REL)
    assert metrics[-1]["eval/loss"] == summary["eval/loss"]
    assert "eval/loss" not in metrics[0]


def test_sft_max_prompt_len_skips_long_prompts(tiny_model, arithmetic_data, tmp_path):
    lengths = [len(p) for p, _ in _examples(tiny_model, arithmetic_data["train"])]
    cut = max(lengths) - 1  # the longest prompts go
    too_long = sum(n > cut for n in lengths)
    assert 0 < too_long < len(lengths)
    summary = sft(_config(tiny_model, arithmetic_data, tmp_path, f"data.max_prompt_len={cut}"))
    assert summary["skipped"] == too_long and summary["examples"] == len(lengths) - too_long


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.mini_batches=2", "actor.mini_batches=2: dockrl sft takes one optimizer step per batch"),
        ("actor.epochs=3", "actor.epochs=3: dockrl sft takes one optimizer step per batch"),
        ("model.ref_path=/some/ref", "model.ref_path='/some/ref': SFT has no reference model"),
        ("data.max_prompt_len=0", "data.max_prompt_len=0: must be >= 1"),
        (
            "actor.fsdp_unit_params=0",
            "actor.fsdp_unit_params=0: dockrl sft runs in one process, without FSDP2",
        ),
    ],
)
def test_sft_refuses_settings_it_cannot_use(tiny_model, arithmetic_data, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message.replace("/", ".")):
        _config(tiny_model, arithmetic_data, tmp_path, override)


def test_sft_eval_limit_without_eval_path_warns(tiny_model, arithmetic_data, tmp_path):
    with pytest.warns(UserWarning, match="data.eval_limit=5 has no effect without data.eval_path"):
        _config(tiny_model, arithmetic_data, tmp_path, "data.eval_limit=5")
