"""rollout.placement=separate: rollout replicas of their own receive the trainer's weights after every update
(gathered over the actor's FSDP ranks, broadcast bucket by bucket over a gloo group of their own) and serve the
dock's rows. A row's tokens depend only on its seed and the weights, so a separate-placement run trains the
same numbers as the colocated one: the computed metrics of two steps are equal, bit for bit."""

import json

from dockrl.cli import main
from runs import computed_metrics, metric_differences

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "dock: {num_warehouses: 2, get_timeout_s: 120}\n"
    # a bucket smaller than the model: every sync sends several buckets
    "reshard: {bucket_mb: 1}\n"
    "run: {steps: 2, prompts_per_step: 4, progress: false, worker_timeout_s: 300, log_samples: 0}\n"
)


def test_separate_rollout_replicas_train_the_same_numbers(ray_session, tmp_path, tiny_model, arithmetic_data):
    config = tmp_path / "grpo.yaml"
    config.write_text(CONFIG)
    base = ["train", str(config), f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}"]
    base += [f"run.output_dir={tmp_path}"]
    assert main([*base, "run.name=colocated"]) == 0
    assert main([*base, "run.name=separate", "rollout.placement=separate", "rollout.replicas=2"]) == 0
    separate, colocated = computed_metrics(tmp_path / "separate"), computed_metrics(tmp_path / "colocated")
    assert separate == colocated, metric_differences(separate, colocated)
    rows = [json.loads(line) for line in (tmp_path / "separate" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["timing/weight_sync"] > 0 for r in rows)  # sent before each step's rollout
    summary = json.loads((tmp_path / "separate" / "summary.json").read_text())
    assert {"rollout-0", "rollout-1", "actor-0", "actor-1"} <= set(summary["worker_nodes"])
