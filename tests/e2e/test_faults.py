"""A dead or hung worker ends the run within 60 s with a one-line error naming it, its step and stage.

Each case runs `dockrl train` (PPO with a reward model, so every worker kind exists: actor, critic, reward,
reward_model, and the dock's warehouse and controller) under DOCKRL_FAULTS, which SIGKILLs (or SIGSTOPs) the
target process when the driver reaches the stage. The run shares the test session's Ray; an alarm fails the
test if the run has not ended 60 s after it started. (tests/e2e/test_resume.py kills a driver in a child process.)

make test kills an actor rank and a dock warehouse and hangs an actor rank; tests/faults/test_fault_matrix.py
(`make test-faults`, CI) kills every other kind the same way, and every kind at every stage in step 2 of 3 (a
worker killed after its last use in a step is noticed by the next step's first wait for it, so the error may
name step 3), and kills before, during and after a save.
"""

import pytest

from fault_runs import DEFAULT_STAGE, IN_MAKE_TEST, _fails_named


@pytest.mark.parametrize("target", IN_MAKE_TEST)
def test_killed_worker_ends_the_run_with_its_name(ppo_args, monkeypatch, capsys, target):
    kill_at, named_stage = DEFAULT_STAGE[target]
    fault = f"kill:{target}:{kill_at}:1:during"
    expect = dict(target=target, stage=named_stage, step=1, cause="died")
    _fails_named(ppo_args, monkeypatch, capsys, fault, f"kill-{target}", **expect)
