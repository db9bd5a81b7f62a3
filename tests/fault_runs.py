"""What the fault tests share (tests/e2e/test_faults.py, tests/faults/test_fault_matrix.py): the PPO run in which
every worker kind exists, and the check that a fault ends it with a one-line error naming the target."""

import signal

import pytest
import ray

from dockrl.cli import main

TIMEOUT_S = 60


CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 1, lr: 1.0e-3, micro_batch_size: 8}\n"
    "algo: {name: ppo, kl_coef: 0.01, kl_in_reward: true}\n"
    "critic: {dp: 1}\n"
    "reward:\n"
    "  functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]\n"
    "  num_processes: 0\n"
    "  model: {weight: 0.5}\n"
    "dock: {num_warehouses: 1, get_timeout_s: 120}\n"
    "run: {steps: 2, prompts_per_step: 4, save_every: 1, progress: false, worker_timeout_s: 300}\n"
)


KINDS = ("actor-0", "critic-0", "reward-0", "reward_model-0", "dockrl-warehouse-0", "dockrl-controller")

# Default run: the driver's stage at which each kind is killed (in step 1), and the stage the error names:
# the target's own call in flight, or for a dock actor the driver's current stage.
# make test kills a worker of the actor group and a dock warehouse; the other kinds are killed the same way in
# tests/faults/test_fault_matrix.py (make test-faults, CI).
IN_MAKE_TEST = ("actor-0", "dockrl-warehouse-0")
DEFAULT_STAGE = {
    "actor-0": ("update", "update"),
    "critic-0": ("compute_values", "compute_values"),
    "reward-0": ("generate", "score"),
    "reward_model-0": ("generate", "score"),
    "dockrl-warehouse-0": ("compute_ref", "compute_ref"),
    "dockrl-controller": ("compute_old", "compute_old"),
}


class _RunTimedOut(Exception):
    pass


def _alarm(signum, frame):
    raise _RunTimedOut(f"the run did not end within {TIMEOUT_S} s of its start")


def _fails_named(ppo_args, monkeypatch, capsys, fault, name, *, target, stage, step, cause, extra=()):
    """Run with `fault`; the run must end (code 1) with the driver's one-line error naming `target`, the
    `cause`, and the step and stage (`step` an int, or a tuple of the steps it may be noticed in)."""
    root, args = ppo_args
    monkeypatch.setenv("DOCKRL_FAULTS", fault)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        code = main([*args, f"run.name={name}", *extra])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    error = next(line for line in err.splitlines() if line.startswith("dockrl train: error: "))
    assert f"{target} (" in error and cause in error, error
    steps = step if isinstance(step, tuple) else (step,)
    assert any(f"at step {s}, stage {stage}" in error for s in steps), error
    checkpoint = "newest checkpoint: step" if max(steps) > 1 else "no checkpoint yet"
    assert f"run.name={name} run.resume=auto ({checkpoint}" in error, error
    for actor in ("actor-0", "critic-0", "reward-0", "reward_model-0", "dockrl-controller"):
        with pytest.raises(ValueError):  # every actor of the run is gone (killed, names free)
            ray.get_actor(actor)
