"""A Hugging Face reward model through the CLI: two GRPO steps scored by a tiny *ForSequenceClassification model."""

import json
import math
from pathlib import Path

import pytest
import torch

from dockrl.cli import main
from dockrl.models.hf import load_state_dict

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory):
    """A tiny qwen2-family reward model made by the CLI, the size of the `tiny_model` policy."""
    out = tmp_path_factory.mktemp("tiny_rm") / "rm"
    assert main(["make-tiny", str(out), "--reward-model", "--seed", "1"]) == 0
    return out


def test_two_steps_with_reward_model_through_cli(
    ray_session, tmp_path, tiny_model, tiny_reward_model, arithmetic_data
):
    code = main(
        [
            "train",
            str(EXAMPLES / "grpo_reward_model_tiny.yaml"),
            f"model.path={tiny_model}",
            f"data.train_path={arithmetic_data['train']}",
            f"reward.model.path={tiny_reward_model}",
            "reward.num_processes=0",
            "run.save_every=2",
            "run.progress=false",
            "run.worker_timeout_s=300",
            "dock.get_timeout_s=120",
            f"run.output_dir={tmp_path}",
            "run.name=rm",
        ]
    )
    assert code == 0
    run = tmp_path / "rm"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("reward/mean", "reward/std", "reward/rm", "train/accuracy", "actor/pg_loss", "actor/kl"):
            assert key in row and math.isfinite(row[key]), key
        assert row["dock/rows"] == 16 and row["actor/grad_norm"] > 0
        assert 0 < row["timing/reward_model"] <= row["timing/reward"]
        # The total is exact_answer (weight 1, equal to its 0/1 accuracy) + 0.5 x the reward model's score.
        assert row["reward/mean"] == pytest.approx(row["train/accuracy"] + 0.5 * row["reward/rm"], abs=1e-5)
        assert row["reward/std"] > 0  # the reward model separates responses even where exact_answer does not
    summary = json.loads((run / "summary.json").read_text())
    trained, initial = load_state_dict(f"{summary['checkpoint']}/hf"), load_state_dict(tiny_model)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "the update moved the weights"
