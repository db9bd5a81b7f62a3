"""Resume timelines (make test-slow): a second resume after two driver kills, resuming an older checkpoint (later ones abandoned, pruning within the timeline), a restart before the first save. tests/e2e/test_resume.py keeps the bit-for-bit resume, a kill mid-save and a restart after an actor kill in make test."""

import json
import shutil

import pytest
import torch

import resume_runs
from dockrl.checkpoint import directory
from dockrl.cli import main
from dockrl.workers.reaper import SWEEP_S
from resume_runs import STEPS, _final_weights, _sharded_model  # noqa: F401 - not every module uses each
from runs import computed_metrics, metric_differences, run_cli, wait_gone

setup = pytest.fixture(scope="module")(resume_runs.setup)
reference = pytest.fixture(scope="module")(resume_runs.reference)
killed = pytest.fixture(scope="module")(resume_runs.killed)


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
