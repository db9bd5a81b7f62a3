"""The full fault-injection matrix: every worker kind killed or hung at every stage ends the run by name, or restarts it (make test-faults)."""

import pytest

from fault_runs import DEFAULT_STAGE, IN_MAKE_TEST, KINDS, _fails_named

STAGES = ("generate", "compute_ref", "compute_old", "compute_values", "update")


@pytest.mark.faults
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("target", KINDS)
def test_fault_matrix_every_kind_at_every_stage(ppo_args, monkeypatch, capsys, target, stage):
    fault = f"kill:{target}:{stage}:2:during"
    expect = dict(target=target, stage="", step=(2, 3), cause="died", extra=["run.steps=3"])
    _fails_named(ppo_args, monkeypatch, capsys, fault, f"m-{target}-{stage}", **expect)


@pytest.mark.faults
@pytest.mark.parametrize("when", ["before", "during", "after", "commit"])
@pytest.mark.parametrize("target", ["actor-0", "critic-0", "dockrl-warehouse-0"])
def test_fault_matrix_kills_around_a_save(ppo_args, monkeypatch, capsys, target, when):
    if target != "actor-0" and when == "commit":
        pytest.skip("commit is the driver's moment; one worker kind covers it")
    fault = f"kill:{target}:save:2:{when}"
    expect = dict(target=target, stage="", step=(2, 3), cause="died", extra=["run.steps=3"])
    _fails_named(ppo_args, monkeypatch, capsys, fault, f"s-{target}-{when}", **expect)


@pytest.mark.parametrize("target", [kind for kind in KINDS if kind not in IN_MAKE_TEST])
def test_killed_worker_of_every_other_kind_ends_the_run_with_its_name(ppo_args, monkeypatch, capsys, target):
    """tests/e2e/test_faults.py's check for the kinds make test leaves out: critic, reward, reward model and
    the dock's controller, each killed in step 1 at the stage DEFAULT_STAGE names."""
    kill_at, named_stage = DEFAULT_STAGE[target]
    fault = f"kill:{target}:{kill_at}:1:during"
    expect = dict(target=target, stage=named_stage, step=1, cause="died")
    _fails_named(ppo_args, monkeypatch, capsys, fault, f"kill-{target}", **expect)
