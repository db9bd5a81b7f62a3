"""What the resume tests share (tests/e2e/test_resume.py, tests/slow/test_resume_timelines.py): one reference
run (4 steps, a checkpoint every 2) and the same run with its driver SIGKILLed while it commits step 4's
checkpoint. Each test module registers the fixtures: `setup = pytest.fixture(scope="module")(resume_runs.setup)`."""

import shutil
from pathlib import Path

import torch

from dockrl.cli import main
from dockrl.models.hf import load_state_dict
from dockrl.workers.reaper import SWEEP_S
from runs import computed_metrics, run_cli, wait_gone, write_config

STEPS = 4


CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4, warmup_steps: 2, min_lr_ratio: 0.5}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "dock: {num_warehouses: 2, get_timeout_s: 120}\n"
    f"run: {{steps: {STEPS}, prompts_per_step: 4, save_every: 2, progress: false, worker_timeout_s: 300}}\n"
)


def setup(tmp_path_factory, tiny_model, arithmetic_data):
    root = tmp_path_factory.mktemp("resume")
    config = write_config(root / "grpo.yaml", CONFIG)
    args = [
        "train",
        str(config),
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        f"run.output_dir={root}",
    ]
    return root, args


def reference(setup, ray_session):
    root, args = setup
    assert main([*args, "run.name=reference"]) == 0
    return root / "reference"


def _final_weights(run_dir: Path) -> dict:
    return load_state_dict(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "hf")


def _sharded_model(actor_dir: Path, out: Path) -> dict:
    """The policy's full tensors (model/*) from a checkpoint's sharded actor/ state (every rank's shards)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(actor_dir, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if k.startswith("model/")}


def killed(setup, reference):
    """The reference run again in a child process whose driver is SIGKILLed while it commits step 4's
    checkpoint: (its computed metrics and its step 4 shards as the kill left them, a copy of its run directory
    taken then). The kill test resumes the run itself; the second-resume test resumes the copy."""
    root, args = setup
    result, marker = run_cli(
        [*args, "run.name=killed"], env={"DOCKRL_FAULTS": f"kill:driver:save:{STEPS}:commit"}
    )
    assert result.returncode == -9, result.stderr[-2000:]
    # Ray's fate-sharing takes the run's workers and daemons down with the driver.
    assert wait_gone(marker, within_s=SWEEP_S + 5) == []  # the reaper's longest sweep, and its own start
    torn = root / "killed" / "checkpoints" / f"step_{STEPS:06d}.tmp"
    assert (torn / "actor").is_dir() and not (torn / "trainer_state.json").exists()  # torn: shards, no state
    shutil.copytree(root / "killed", root / "killed_copy")
    return (
        computed_metrics(root / "killed"),
        _sharded_model(torn / "actor", root / "killed.pt"),
        root / "killed_copy",
    )
