"""A dead or hung worker ends the run within 60 s with a one-line error naming it, its step and stage.

Each case runs `dockrl train` (PPO with a reward model, so every worker kind exists: actor, critic, reward,
reward_model, and the dock's warehouse and controller) under DOCKRL_FAULTS, which SIGKILLs (or SIGSTOPs) the
target process when the driver reaches the stage. The run shares the test session's Ray; an alarm fails the
test if the run has not ended 60 s after it started. (tests/test_resume.py kills a driver in a child process.)

The default run has one kill per worker kind and one hang; the full matrix (every kind x every stage, and
kills before, during and after a save) carries the `faults` marker: `make test-faults`. The matrix kills in
step 2 of 3: a worker killed after its last use in a step (a reward worker during the update) is noticed by
the next step's first wait for it, so the error may name step 3.
"""

import signal

import pytest
import ray

from dockrl.cli import main
from runs import write_config

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
STAGES = ("generate", "compute_ref", "compute_old", "compute_values", "update")
# Default run: the driver's stage at which each kind is killed (in step 1), and the stage the error names:
# the target's own call in flight, or for a dock actor the driver's current stage.
DEFAULT_STAGE = {
    "actor-0": ("update", "update"),
    "critic-0": ("compute_values", "compute_values"),
    "reward-0": ("generate", "score"),
    "reward_model-0": ("generate", "score"),
    "dockrl-warehouse-0": ("compute_ref", "compute_ref"),
    "dockrl-controller": ("compute_old", "compute_old"),
}


@pytest.fixture(scope="module")
def ppo_args(tmp_path_factory, tiny_model, arithmetic_data, ray_session):
    from dockrl.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("faults")
    reward_model = make_tiny(
        root / "rm", family="qwen2", hidden_size=64, num_layers=2, seed=1, reward_model=True
    )
    config = write_config(root / "ppo.yaml", CONFIG)
    return root, [
        "train",
        str(config),
        f"model.path={tiny_model}",
        f"reward.model.path={reward_model}",
        f"data.train_path={arithmetic_data['train']}",
        f"run.output_dir={root}",
    ]


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


@pytest.mark.parametrize("target", KINDS)
def test_killed_worker_ends_the_run_with_its_name(ppo_args, monkeypatch, capsys, target):
    kill_at, named_stage = DEFAULT_STAGE[target]
    fault = f"kill:{target}:{kill_at}:1:during"
    expect = dict(target=target, stage=named_stage, step=1, cause="died")
    _fails_named(ppo_args, monkeypatch, capsys, fault, f"kill-{target}", **expect)


def test_hung_worker_ends_the_run_after_the_heartbeat_timeout(ppo_args, monkeypatch, capsys):
    fault = "hang:actor-0:compute_ref:1:during"
    # 10 s, not the default 30: short for the test, long enough that a busy machine never starves a healthy
    # worker's heartbeat thread that long
    expect = dict(
        target="actor-0",
        stage="compute_ref",
        step=1,
        cause="hung: no heartbeat",
        extra=["run.heartbeat_timeout_s=10"],
    )
    _fails_named(ppo_args, monkeypatch, capsys, fault, "hang-actor", **expect)


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
