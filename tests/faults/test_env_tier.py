"""The environment tier (workers/env.py) over real Ray processes: a worker that dies or stops answering costs
only the trajectories it held, is started again, and serves later trajectories."""

import os
import signal
import time

import pytest

from dockrl.config.specs import EnvSpec
from dockrl.workers.env import TierEnvs, start_env_workers

ENV_CODE = '''
import os
import time

from dockrl.envs.base import Observation


class Fragile:
    """`die` kills its worker process; `sleep <s>` takes s seconds; anything else is answered at once."""

    tools = []

    def reset(self, row):
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message):
        if message == "die":
            os._exit(1)
        if message.startswith("sleep"):
            time.sleep(float(message.split()[1]))
        return Observation(messages=[{"role": "tool", "content": f"pid {os.getpid()}"}])
'''


def _spec(num_workers: int) -> EnvSpec:
    return EnvSpec(
        name="fragile_env.py:Fragile",
        kwargs={},
        code=ENV_CODE,
        origin="fragile_env.py",
        max_turns=4,
        max_tool_calls=8,
        max_response_tokens=100,
        policy_budget=64,
        call_timeout_s=30.0,
        num_workers=num_workers,
        concurrency=4,
        reward_weight=1.0,
        system_prompt=None,
    )


def _drain(tier: TierEnvs, count: int) -> dict:
    got: dict = {}
    for _ in range(600):  # bounded: each look waits at most 0.5 s
        for row, outcome in tier.ready(0.5):
            got[row] = outcome
        if len(got) == count:
            return got
    raise AssertionError(f"{len(got)} of {count} outcomes came back")


@pytest.fixture()
def workers(ray_session):
    import ray

    started = start_env_workers(_spec(2), "qwen2", [])
    yield started
    for worker in started:
        ray.kill(worker, no_restart=True)


def test_a_dead_worker_costs_only_its_trajectories(workers):
    tier = TierEnvs(workers, "test")
    for row in range(6):
        tier.reset(row, {"prompt": "go"}, 30.0)
    assert {o.kind for o in _drain(tier, 6).values()} == {"ok"}
    on_first = sorted(r for r, w in tier.home.items() if w == 0)
    assert len(on_first) == 3  # least busy first: the rows alternate
    for row in range(6):
        message = "die" if row == on_first[0] else ("sleep 1" if row in on_first else "fine")
        tier.step(row, message, 30.0, 8)
    outcomes = _drain(tier, 6)
    failed = sorted(r for r, o in outcomes.items() if o.kind == "error")
    assert failed == on_first  # the dying call and the calls that were running beside it
    assert all(outcomes[r].kind == "ok" for r in range(6) if r not in on_first)
    # Ray starts the worker again: a new trajectory on it is served
    for row in on_first:
        tier.drop(row)
    tier.reset(10, {"prompt": "again"}, 30.0)
    assert tier.home[10] == 0
    assert _drain(tier, 1)[10].kind == "ok"
    tier.step(10, "fine", 30.0, 8)
    assert _drain(tier, 1)[10].kind == "ok"


@pytest.mark.parametrize("tries", [0, None])
def test_a_trajectory_started_while_its_worker_restarts_is_served(workers, monkeypatch, tries):
    """A reset sent at once after its worker was killed reaches the dead process (Ray has not yet learnt of
    the death): it is sent again to the restarted worker. With RESET_TRIES=0 (broken on purpose) it fails."""
    import ray

    import dockrl.workers.env as env_tier

    if tries is not None:
        monkeypatch.setattr(env_tier, "RESET_TRIES", tries)
    tier = TierEnvs(workers, "test")
    pid = ray.get(workers[0].ping.remote())
    os.kill(pid, signal.SIGKILL)
    tier.reset(0, {"prompt": "go"}, 30.0)  # the first reset goes to worker 0 (round robin)
    assert tier.home[0] == 0
    outcome = _drain(tier, 1)[0]
    if tries == 0:
        assert outcome.kind == "error" and "worker 0 failed" in outcome.error
        return
    assert outcome.kind == "ok"
    tier.step(0, "fine", 30.0, 8)
    step = _drain(tier, 1)[0]
    assert step.kind == "ok" and step.observation.messages[0]["content"] != f"pid {pid}"  # restarted


def test_a_worker_that_stops_answering_is_killed_and_replaced(workers):
    import ray

    tier = TierEnvs(workers, "test", hung_grace_s=0.5, ping_s=1.0)
    tier.reset(0, {"prompt": "go"}, 30.0)
    tier.reset(1, {"prompt": "go"}, 30.0)
    assert {o.kind for o in _drain(tier, 2).values()} == {"ok"}
    stopped = tier.home[0]
    pid = ray.get(workers[stopped].ping.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        tier.step(0, "fine", 0.5, 8)
        tier.step(1, "fine", 0.5, 8)
        outcomes = _drain(tier, 2)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert outcomes[0].kind == "error" and outcomes[1].kind == "ok"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the restarted process answers with a new pid
        try:
            if ray.get(workers[stopped].ping.remote(), timeout=5) != pid:
                break
        except Exception:
            time.sleep(0.5)
    else:
        raise AssertionError("the stopped worker was not started again")


DIES_ONCE = '''
import os

from dockrl.envs.base import Observation


class DiesOnce:
    """The first step call of the run kills its environment worker; every other trajectory answers twice."""

    tools = []

    def __init__(self, marker):
        self.marker, self.t = marker, 0

    def reset(self, row):
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        self.t += 1
        if self.t >= 2:
            return Observation(done=True, reward=1.0)
        return Observation(messages=[{"role": "tool", "content": "again"}], info={"tool_calls": 1})
'''


def test_a_killed_environment_worker_costs_only_its_trajectories_in_a_run(
    ray_session, tmp_path, tiny_model, arithmetic_data
):
    import json

    from dockrl.cli import main
    from runs import tiny_paths

    (tmp_path / "dies_env.py").write_text(DIES_ONCE)
    config = tmp_path / "dies.yaml"
    config.write_text(
        "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
        "actor: {dp: 1, lr: 1.0e-3, micro_batch_size: 4}\n"
        "reward: {functions: [{name: exact_answer}]}\n"
        "run: {steps: 2, prompts_per_step: 2, progress: false, worker_timeout_s: 300, precision: fp32}\n"
        f"env: {{name: ./dies_env.py:DiesOnce, kwargs: {{marker: '{tmp_path / 'died'}'}}, max_turns: 3, "
        "max_response_tokens: 120, num_workers: 2}\n"
    )
    args = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    assert main([*args, f"run.output_dir={tmp_path}", "run.name=dies"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "dies" / "metrics.jsonl").read_text().splitlines()]
    # step 1: the dead worker's trajectories (half of the 8, as rows alternate between the two) failed, the
    # others finished; step 2: the worker was started again and nothing failed
    assert 1 <= rows[0]["env/failed"] <= 4 and rows[0]["env/turns"] > 0
    assert rows[1]["env/failed"] == 0 and rows[1]["env/turns"] == 2.0
