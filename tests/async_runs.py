"""What the asynchronous-run tests share (tests/slow/test_separate_rollout.py, tests/slow/test_async_stragglers.py):
the separate-rollout config and one uninterrupted two-steps-ahead run. Each module registers the fixture:
`two_ahead = pytest.fixture(scope="module")(async_runs.two_ahead)`."""

from dockrl.cli import main
from runs import computed_metrics, tiny_paths

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


def two_ahead(ray_session, tmp_path_factory, tiny_model, arithmetic_data):
    """An uninterrupted rollout.max_staleness=2 run of 5 steps, checkpointed after every step: (its run root,
    its computed metrics, the arguments that ran it). With run.save_every=1 < max_staleness every step from 3
    on is in flight at two saves (generated during step t - 2's training, trained at step t)."""
    root = tmp_path_factory.mktemp("two_ahead")
    config = root / "grpo.yaml"
    config.write_text(CONFIG.replace("steps: 2", "steps: 5"))
    base = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    base += [f"run.output_dir={root}", "rollout.placement=separate", "rollout.max_staleness=2"]
    base += ["run.save_every=1", "run.keep_checkpoints=null"]
    assert main([*base, "run.name=whole"]) == 0
    return root, computed_metrics(root / "whole"), base
