"""Multi-turn GRPO end to end through the CLI: the built-in tool environment colocated, and a user environment
(a file next to the config) on a separate rollout replica one step off-policy; config errors before Ray."""

import json
import math

from dockrl.cli import main
from dockrl.config import TrainConfig, load_config
from dockrl.envs import sandbox
from runs import tiny_paths

ENV_FILE = '''
from dockrl.envs.base import Observation


class Echo:
    """Answers each assistant message with a tool message until `turns` turns, then ends with a reward."""

    tools = []

    def __init__(self, turns=3):
        self.turns, self.t = turns, 0

    def reset(self, row):
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message):
        self.t += 1
        if self.t >= self.turns:
            return Observation(done=True, reward=1.0 if len(message) % 2 else 0.0)
        return Observation(messages=[{"role": "tool", "content": f"turn {self.t}"}], info={"tool_calls": 1})
'''

SLOW_ENV_FILE = '''
import os
import time

from dockrl.envs.base import Observation


class SlowEcho:
    """Echo's turns, each step taking `seconds` and leaving one line in `log` (the calls that ran)."""

    tools = []

    def __init__(self, log, seconds=0.2, turns=3):
        self.log, self.seconds, self.turns, self.t = log, seconds, turns, 0

    def reset(self, row):
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message):
        self.t += 1
        time.sleep(self.seconds)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        if self.t >= self.turns:
            return Observation(done=True, reward=1.0)
        return Observation(messages=[{"role": "tool", "content": f"turn {self.t}"}], info={"tool_calls": 1})
'''

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 1, lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}]}\n"
    "run: {steps: 2, prompts_per_step: 2, progress: false, worker_timeout_s: 300, precision: fp32}\n"
)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_builtin_tool_environment_runs_colocated(ray_session, tmp_path, tiny_model, arithmetic_data):
    config = tmp_path / "tools.yaml"
    # the python tool needs its sandbox (bubblewrap, which `make test` installs where it may)
    tools = "[calculator, python]" if sandbox.bwrap() is not None else "[calculator]"
    config.write_text(CONFIG + f"env: {{name: tools, kwargs: {{tools: {tools}}}, max_turns: 2}}\n")
    args = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    args += [
        f"data.eval_path={arithmetic_data['test']}",
        "data.eval_limit=4",
    ]  # held-out trajectories at the end
    assert main([*args, f"run.output_dir={tmp_path}", "run.name=tools", "run.steps=1"]) == 0
    (row,) = _rows(tmp_path / "tools")
    summary = json.loads((tmp_path / "tools" / "summary.json").read_text())
    assert (
        summary["eval_accuracy"] == 0.0
    )  # a random model answers no held-out problem, with or without tools
    # A random model calls no tool: each trajectory is one turn the environment ends (done).
    assert row["env/turns"] >= 1 and row["env/failed"] == 0 and math.isfinite(row["actor/kl"])
    assert row["env/tool_call_rate"] == row["env/tool_calls"]  # at most one call per trajectory here


def test_a_user_environment_runs_on_a_separate_replica_one_step_off_policy(
    ray_session, tmp_path, tiny_model, arithmetic_data
):
    (tmp_path / "echo_env.py").write_text(ENV_FILE)
    config = tmp_path / "echo.yaml"
    config.write_text(
        CONFIG
        + "env: {name: ./echo_env.py:Echo, kwargs: {turns: 3}, max_turns: 4, max_response_tokens: 120}\n"
    )
    args = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    args += [
        f"run.output_dir={tmp_path}",
        "run.name=echo",
        "rollout.placement=separate",
        "rollout.max_staleness=1",
    ]
    assert main(args) == 0
    rows = _rows(tmp_path / "echo")
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0]
    for row in rows:
        assert row["env/turns"] == 3.0 and row["env/tool_calls"] == 2.0 and row["env/truncated"] == 0.0
        # exact_answer scores the final turn (0 for a random model); the environment's reward is 0 or 1.
        assert 0.0 <= row["reward/mean"] <= 1.0 and row["timing/env"] >= 0.0
        # Observation tokens are in the response but not in the loss: more response tokens than trained ones.
        assert row["response_length/mean"] > 3 * 6


def test_tensor_parallel_rollout_with_an_environment_worker_busier_than_its_limit(
    ray_session, tmp_path, tiny_model, arithmetic_data
):
    """rollout.tp=2 (dockrl engine) with one environment worker running one call at a time: 8 trajectories in
    flight, steps of 0.2 s against a 1 s limit. A queued call would wait up to 8 x 0.2 = 1.6 s, so a clock
    started at submission would cut some; the tp peers stay in lockstep, and every call runs once (2 steps x 8
    trajectories x 3 calls = 48; twice that if each peer ran its own)."""
    (tmp_path / "slow_env.py").write_text(SLOW_ENV_FILE)
    log = tmp_path / "calls.log"
    config = tmp_path / "slow.yaml"
    config.write_text(
        CONFIG
        + f"env: {{name: ./slow_env.py:SlowEcho, kwargs: {{log: '{log}'}}, max_turns: 4, "
        + "max_response_tokens: 120, call_timeout_s: 1.0, num_workers: 1, concurrency: 1}\n"
    )
    args = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    args += [
        f"run.output_dir={tmp_path}",
        "run.name=tp",
        "actor.dp=2",
        "rollout.tp=2",
        "run.prompts_per_step=2",
    ]
    assert main(args) == 0
    rows = _rows(tmp_path / "tp")
    assert len(rows) == 2
    for row in rows:
        assert row["env/timeouts"] == 0.0 and row["env/truncated"] == 0.0 and row["env/failed"] == 0.0
        assert row["env/turns"] == 3.0
    calls = log.read_text().split()
    assert len(calls) == 2 * 8 * 3 and len(set(calls)) == 1  # once each, in the one environment worker


def test_multi_turn_settings_are_checked_before_ray(tmp_path, tiny_model, arithmetic_data, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(CONFIG)
    base = ["train", str(config), *tiny_paths(tiny_model, arithmetic_data)]
    for overrides, message in [
        (["env.name=nowhere"], "unknown environment 'nowhere'"),
        (["env.name=./missing.py:Env"], "no file './missing.py'"),
        (["env.name=tools", "algo.name=ppo"], "multi-turn (env.name) trains with group-baseline advantages"),
        (["env.name=tools", "env.kwargs={tools: [search]}"], "unknown tools ['search']"),
        (["env.name=tools", "env.max_response_tokens=4"], "env.max_response_tokens=4"),
    ]:
        assert main([*base, *overrides, f"run.output_dir={tmp_path}"]) == 2, overrides
        assert message in capsys.readouterr().err, overrides


def test_env_file_source_is_read_with_the_config(tmp_path):
    (tmp_path / "echo_env.py").write_text(ENV_FILE)
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {path: m}\ndata: {train_path: d}\nrun: {steps: 1, prompts_per_step: 1}\nenv: {name: ./echo_env.py:Echo}\n"
    )
    cfg = load_config(TrainConfig, config)
    assert cfg.env.code == ENV_FILE and cfg.env.source_file == str((tmp_path / "echo_env.py").resolve())
