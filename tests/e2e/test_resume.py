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

import pytest
import torch

import resume_runs
from dockrl.cli import main
from resume_runs import STEPS, _final_weights, _sharded_model  # noqa: F401 - not every module uses each
from runs import computed_metrics, metric_differences

setup = pytest.fixture(scope="module")(resume_runs.setup)
reference = pytest.fixture(scope="module")(resume_runs.reference)
killed = pytest.fixture(scope="module")(resume_runs.killed)


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
