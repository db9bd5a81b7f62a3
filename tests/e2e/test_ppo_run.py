"""PPO with a critic through the CLI: two steps on the tiny model, the critic's figures and its checkpoint."""

import json
import math
from pathlib import Path

import pytest
import torch

from dockrl.cli import main
from dockrl.models.hf import load_state_dict
from dockrl.models.value import load_value_model
from runs import tiny_paths

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


REQUIRED = [
    "reward/mean",
    "reward/kl_coef",
    "reward/kl_penalty",
    "critic/value_loss",
    "critic/explained_variance",
    "critic/value_clipfrac",
    "critic/grad_norm",
    "critic/values_mean",
    "critic/returns_mean",
    "timing/update",
]


def test_two_ppo_steps_through_cli(ray_session, tmp_path, tiny_model, arithmetic_data):
    code = main(
        [
            "train",
            str(EXAMPLES / "ppo_tiny.yaml"),
            *tiny_paths(tiny_model, arithmetic_data),
            # A random model never answers right; a length reward gives the returns spread to fit.
            "reward.functions=[{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]",
            "reward.num_processes=0",
            "critic.dp=2",  # two critic ranks: values, GAE and the critic's statistics are split over them
            "critic.mini_batches=2",  # the second optimizer step starts from moved values: clipping can bind
            "algo.kl_horizon=16",  # one step of 16 rows moves the coefficient by the full 20%
            "run.save_every=2",
            "run.progress=false",
            "run.worker_timeout_s=300",
            "dock.get_timeout_s=120",
            f"run.output_dir={tmp_path}",
            "run.name=ppo",
        ]
    )
    assert code == 0
    run = tmp_path / "ppo"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in REQUIRED:
            assert key in row and row[key] is not None and math.isfinite(row[key]), key
        assert row["dock/rows"] == 16 and row["critic/grad_norm"] > 0 and row["critic/value_loss"] > 0
        assert 0 <= row["critic/value_clipfrac"] <= 1 and row["critic/explained_variance"] <= 1
    # step 1 is the critic's warm-up: the actor does not update; step 2 it does
    assert "actor/pg_loss" not in rows[0]
    assert math.isfinite(rows[1]["actor/pg_loss"]) and rows[1]["actor/grad_norm"] > 0
    # the policy has not moved from the reference yet (KL 0 < target), so the adaptive controller lowers
    # the coefficient by the largest step: 0.01 x (1 - 0.2 x 16 rows / horizon 16) = 0.008
    assert rows[0]["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["reward/kl_coef"] == pytest.approx(0.01) and rows[1]["reward/kl_coef"] == pytest.approx(
        0.008
    )
    summary = json.loads((run / "summary.json").read_text())
    trained, initial = load_state_dict(Path(summary["checkpoint"]) / "hf"), load_state_dict(tiny_model)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), (
        "the actor's update moved the weights"
    )
    critic_dir = Path(summary["checkpoint"]) / "critic" / "hf"  # what critic.path=<checkpoint root> loads
    critic, fresh = (
        load_value_model(critic_dir).state_dict(),
        load_value_model(tiny_model, seed=0).state_dict(),
    )
    assert set(critic) == set(fresh) and not torch.equal(critic["score.weight"], fresh["score.weight"])
