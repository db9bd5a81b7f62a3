"""Exact resume: kill -9 of the driver, then run.resume=auto, repeats the uninterrupted run bit for bit.

One reference run (4 steps, a checkpoint every 2) is compared with:
- a run whose driver is killed with SIGKILL while it saves step 4's checkpoint (the workers' shards are
  written, trainer_state.json and the rename are not: a torn checkpoint). Up to the kill it is the same run
  again in another process: its 4 steps' metrics and the shards of step 4 equal the reference's bit for bit
  (dockrl is repeatable run to run). Resumed with run.resume=auto it must ignore the torn step 4, continue from
  step 2, and end with identical metrics and weights; a copy of it, taken before that resume, is resumed and
  killed once more by the second-resume test;
- a resume with a changed setting, refused before Ray starts with the key named.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dockrl.checkpoint import directory
from dockrl.cli import main
from dockrl.models.hf import load_state_dict
from dockrl.workers.reaper import SWEEP_S
from runs import computed_metrics, metric_differences, run_cli, wait_gone, write_config

STEPS = 4
CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 4, warmup_steps: 2, min_lr_ratio: 0.5}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "dock: {num_warehouses: 2, get_timeout_s: 120}\n"
    f"run: {{steps: {STEPS}, prompts_per_step: 4, save_every: 2, progress: false, worker_timeout_s: 300}}\n"
)


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
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


def test_runs_repeat_bitwise(setup, reference, killed):
    root, _ = setup
    metrics, shards, _ = killed
    # The killed run logged all 4 steps before the kill (in another process, with its own Ray) and wrote the
    # workers' shards of step 4: the same numbers and the same policy, bit for bit.
    reference_metrics = computed_metrics(reference)
    assert metrics == reference_metrics, metric_differences(metrics, reference_metrics)
    step4 = reference / "checkpoints" / f"step_{STEPS:06d}"
    expected = _sharded_model(step4 / "actor", root / "reference.pt")
    assert shards.keys() == expected.keys() and len(expected) > 0
    assert all(torch.equal(shards[k], expected[k]) for k in expected)
    # checkpoints hold the sharded state and a Hugging Face export; nothing is left half-written
    step = reference / "checkpoints" / "step_000002"
    assert {p.name for p in step.iterdir()} == {"actor", "hf", "trainer_state.json"}
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["sampler"]["position"] == 8 and len(state["config_hash"]) == 16


def test_driver_killed_mid_save_resumes_exactly(setup, reference, killed):
    root, args = setup
    run = root / "killed"
    assert len(killed[0]) == STEPS  # step 4 was logged before the save began

    assert main([*args, "run.name=killed", "run.resume=auto"]) == 0
    assert not (run / "checkpoints" / f"step_{STEPS:06d}.tmp").exists()
    resumed, expected = computed_metrics(run), computed_metrics(reference)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # steps 3-4 replaced, not duplicated
    assert resumed == expected, metric_differences(resumed, expected)
    final, ref = _final_weights(run), _final_weights(reference)
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_changed_config_is_refused_with_the_keys_named(setup, reference, capsys):
    root, args = setup
    code = main([*args, "run.name=reference", "run.resume=auto", "actor.lr=2e-3", "run.max_restarts=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "actor.lr: 0.001 -> 0.002" in err and "run.resume_force=true" in err
    assert "max_restarts" not in err  # recovery settings do not change the computation


def test_resume_settings_are_checked_before_ray(setup, capsys):
    root, args = setup
    assert main([*args, "run.resume=auto"]) == 2  # no run.name: nothing could ever be resumed
    assert "set run.name" in capsys.readouterr().err
    assert main([*args, "run.name=x", f"run.resume={root}/nowhere/step_000002"]) == 2
    assert "not never, auto, or a complete checkpoint" in capsys.readouterr().err


def test_restart_after_an_actor_kill_ends_with_identical_metrics(setup, reference, monkeypatch):
    root, args = setup
    # actor-1 is killed while step 3 updates; the run restarts every worker and the dock, resumes from
    # step 2's checkpoint and replays step 3 undisturbed (a fault fires once per driver)
    monkeypatch.setenv("DOCKRL_FAULTS", "kill:actor-1:update:3:during")
    assert main([*args, "run.name=restarted", "run.max_restarts=1"]) == 0
    run = root / "restarted"
    restarted, expected = computed_metrics(run), computed_metrics(reference)
    assert restarted == expected, metric_differences(restarted, expected)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("run/restarts", 0) for r in rows] == [0, 0, 1, 1]  # logged from the replayed step on
    summary = json.loads((run / "summary.json").read_text())
    assert len(summary["restarts"]) == 1 and "actor-1 (" in summary["restarts"][0]["cause"]
    assert summary["restarts"][0]["resume_from"].endswith("step_000002")
    final, ref = _final_weights(run), _final_weights(reference)
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_a_checkpoint_root_as_model_path_keeps_the_runs_reference(
    setup, reference, tiny_model, arithmetic_data
):
    from dockrl.config import TrainConfig, load_config
    from dockrl.recipes.preflight import preflight_train

    root = reference / "checkpoints" / "step_000002"
    overrides = [f"model.path={root}", f"data.train_path={arithmetic_data['train']}"]
    with pytest.warns(UserWarning, match="KL reference stays"):
        cfg = preflight_train(load_config(TrainConfig, setup[0] / "grpo.yaml", overrides)).cfg
    assert cfg.model.path == str(root / "hf") and cfg.model.ref_path == str(tiny_model)


def test_a_second_resume_after_two_driver_kills_repeats_the_run_exactly(setup, reference, killed, tiny_model):
    """kill -9 of the driver, run.resume=auto, kill -9 again, run.resume=auto again. The second resume loads a
    checkpoint the first resumed run wrote: the config it records must still be the user's (a resumed run once
    wrote its resolved KL reference into model.ref_path, so every second resume was refused as a config
    change); the reference itself is recorded as trainer_state's reference_path. The first kill is the kill
    test's (a copy of its run as the kill left it: step 2 committed, step 4 torn); the first resume saves every
    step (run.save_every=1, a neutral key), so it commits step 3 before it is killed committing step 4."""
    from dockrl.checkpoint.directory import newest_checkpoint, read_trainer_state

    root, args = setup
    run = root / "twice"
    shutil.copytree(killed[2], run)
    checkpoints = run / "checkpoints"
    assert newest_checkpoint(checkpoints).name == "step_000002"  # the first kill's newest checkpoint
    args = [*args, "run.name=twice", "run.save_every=1", "run.resume=auto"]
    resumed, marker = run_cli(args, env={"DOCKRL_FAULTS": f"kill:driver:save:{STEPS}:commit"}, timeout=600)
    assert resumed.returncode == -9, resumed.stderr[-2000:]
    assert wait_gone(marker, within_s=SWEEP_S + 5) == []
    assert newest_checkpoint(checkpoints).name == f"step_{STEPS - 1:06d}"
    state = read_trainer_state(checkpoints / f"step_{STEPS - 1:06d}")  # written by the resumed run
    assert state["config"]["model.ref_path"] is None and state["reference_path"] == str(tiny_model)

    assert main(args) == 0
    resumed, expected = computed_metrics(run), computed_metrics(reference)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert resumed == expected, metric_differences(resumed, expected)
    final, ref = _final_weights(run), _final_weights(reference)
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_resuming_an_older_checkpoint_restarts_and_prunes_within_its_own_timeline(
    setup, reference, monkeypatch
):
    """run.resume=<step 2> in a run directory that reached step 4, saving every step with keep_checkpoints=1:
    the old step 4 is renamed step_000004.abandoned (kept) before step 3 runs, so step 3's prune spares the
    new step 3, and actor-1 killed in step 4 restarts from it, not from the abandoned step 4 (which, ranked by
    step, would also have made step 3's prune delete step 3)."""
    import shutil

    root, args = setup
    run = root / "older"
    shutil.copytree(reference, run)
    checkpoints = run / "checkpoints"
    origin = checkpoints / "step_000002"
    monkeypatch.setenv("DOCKRL_FAULTS", "kill:actor-1:update:4:during")
    resume = [f"run.resume={origin}", "run.save_every=1", "run.keep_checkpoints=1", "run.max_restarts=1"]
    assert main([*args, "run.name=older", *resume]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"][0]["resume_from"] == str(checkpoints / "step_000003")
    assert [p.name for _, p in directory.complete_checkpoints(checkpoints)] == ["step_000004"]
    abandoned = checkpoints / "step_000004.abandoned"
    assert directory.read_trainer_state(abandoned)["parent"] == str(reference / "checkpoints" / "step_000002")
    assert directory.read_trainer_state(checkpoints / "step_000004")["parent"] == str(
        checkpoints / "step_000003"
    )
    resumed, expected = computed_metrics(run), computed_metrics(reference)
    assert resumed == expected, metric_differences(resumed, expected)
    final, ref = _final_weights(run), _final_weights(reference)
    assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_a_restart_before_the_first_save_continues_from_another_runs_checkpoint(
    setup, reference, monkeypatch
):
    """run.resume=<the reference run's step 2> into a new run directory; actor-1 is killed in step 3, before
    this run's first save (step 4): the restart continues from that checkpoint (its metrics copied again), not
    from step 1 and the base model with the copied metrics wiped."""
    root, args = setup
    origin = reference / "checkpoints" / "step_000002"
    monkeypatch.setenv("DOCKRL_FAULTS", "kill:actor-1:update:3:during")
    assert main([*args, "run.name=foreign", f"run.resume={origin}", "run.max_restarts=1"]) == 0
    run = root / "foreign"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"][0]["resume_from"] == str(origin)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("run/restarts", 0) for r in rows] == [0, 0, 1, 1]  # steps 1-2 copied, 3-4 after the restart
    assert directory.read_trainer_state(run / "checkpoints" / "step_000004")["parent"] == str(origin)
    resumed, expected = computed_metrics(run), computed_metrics(reference)
    assert resumed == expected, metric_differences(resumed, expected)
    final, ref = _final_weights(run), _final_weights(reference)
    assert all(torch.equal(final[k], ref[k]) for k in ref)
