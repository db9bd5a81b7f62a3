"""End to end (slow tier): a GRPO step through the CLI with context parallelism, (dp, cp) = (2, 2) on 4 actor ranks, against the
same step with (dp, cp) = (2, 1) on 2 ranks.

Both runs sample the same responses: each row's sampling seed is a function of (run seed, step, row) only
(engines/rollout/dock_feed.row_seed), whichever replica serves it, and the weights are the same. Their first update
then trains the same rows, so its figures agree up to fp32 reassociation: the cp run's attention sums keys in ring
blocks merged by log-sum-exp, its gradients are summed over 4 ranks instead of 2, each a few hundred O(1) terms,
which moves a figure by ~1e2 x eps_fp32 = 1e-5 relative at most; 1e-4 relative leaves 10x for other CPUs (the
bound of tests/distributed/test_cp_equivalence.py). actor/entropy checks the split forward (every response token's
entropy under the model) and actor/grad_norm the split backward. The step's loss is compared too, though at the
first, on-policy step its policy term is -mean(A) and its KL 0 whatever the model computes.
"""

import json

import pytest

from dockrl.cli import main

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 24, groups_per_pull: 2, tp: 1, temperature: 1.0}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {kl_coef: 0.01, entropy_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "run: {steps: 1, prompts_per_step: 4, progress: false, worker_timeout_s: 300, precision: fp32}\n"
)
COMPARED = ("actor/loss", "actor/entropy", "actor/grad_norm", "actor/kl", "response_length/mean")


def _first_step(tmp_path, name: str, tiny_model, arithmetic_data, overrides: list[str]) -> dict:
    config = tmp_path / f"{name}.yaml"
    config.write_text(CONFIG)
    code = main(
        [
            "train",
            str(config),
            f"model.path={tiny_model}",
            f"data.train_path={arithmetic_data['train']}",
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            *overrides,
        ]
    )
    assert code == 0
    return json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])


def test_cp2_first_step_equals_cp1(ray_session, tmp_path, tiny_model, arithmetic_data):
    cp1 = _first_step(tmp_path, "cp1", tiny_model, arithmetic_data, [])
    cp2 = _first_step(tmp_path, "cp2", tiny_model, arithmetic_data, ["actor.cp=2"])
    assert cp1["actor/grad_norm"] > 0 and cp1["actor/entropy"] > 0
    for key in COMPARED:
        assert cp2[key] == pytest.approx(cp1[key], rel=1e-4, abs=1e-7), (key, cp2[key], cp1[key])
