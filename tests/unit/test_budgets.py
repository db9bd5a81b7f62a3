"""A multi-turn trajectory's budgets (config/budgets.py): the default makes room for every allowed turn, a budget
set too small to hold env.max_turns turns is refused by name, and Dr. GRPO's constant normaliser and DAPO's
overlong shaping count the policy's sampled tokens (its budget), not rollout.max_new_tokens."""

import pytest

from dockrl.config import ConfigError, TrainConfig, check_train, load_config, resolve
from dockrl.config.specs import specs

REQUIRED = [
    "model.path=/models/tiny",
    "data.train_path=/data/train.jsonl",
    "run.steps=2",
    "run.prompts_per_step=2",
]
MULTI_TURN = ["env.name=tools", "env.max_turns=3", "rollout.max_new_tokens=16"]


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*REQUIRED, *overrides])


def test_the_default_budget_holds_every_turn_and_its_observations():
    cfg = _cfg(*MULTI_TURN, "env.max_observation_tokens=40")
    check_train(cfg)
    rollout = specs(cfg, resolve(cfg).plan).rollout
    assert rollout.response_budget == 3 * 16 + 2 * 40  # turns at their limit, observations between them
    assert rollout.env.policy_budget == 3 * 16


def test_a_budget_that_cannot_hold_the_turns_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"env.max_response_tokens=49: cannot hold env.max_turns=3 turns"):
        check_train(_cfg(*MULTI_TURN, "env.max_response_tokens=49"))
    check_train(_cfg(*MULTI_TURN, "env.max_response_tokens=50"))  # 3 x 16 and one token of each observation


def test_dr_grpo_and_overlong_shaping_count_against_the_policy_budget():
    single = _cfg("algo.name=dr_grpo", "rollout.max_new_tokens=16")
    assert resolve(single).plan.loss.seq_len_norm == 16.0
    cfg = _cfg("algo.name=dr_grpo", *MULTI_TURN, "env.max_response_tokens=200")
    resolved = resolve(cfg)
    assert (
        resolved.plan.loss.seq_len_norm == 3 * 16.0
    )  # not rollout.max_new_tokens, nor the 200 with observations
    dapo = _cfg("algo.name=dapo", *MULTI_TURN, "env.max_response_tokens=40")  # a budget under 3 x 16: refused
    with pytest.raises(ConfigError):
        check_train(dapo)
    dapo = _cfg("algo.name=dapo", *MULTI_TURN, "env.max_response_tokens=60", "algo.overlong_buffer_len=4")
    reward = specs(dapo, resolve(dapo).plan).reward
    assert reward.max_new_tokens == 3 * 16 and reward.env_weight is not None  # sampled tokens vs 48, masked


def test_env_code_runs_only_for_a_file_environment():
    with pytest.raises(
        ConfigError, match=r"env.code: set with env.name='tools', which is not a file reference"
    ):
        _cfg("env.name=tools", "env.code=import os")
    with pytest.raises(ConfigError, match=r"env.name='pkg.mod:Env', which is not a file reference"):
        _cfg("env.name=pkg.mod:Env", "env.code=import os")
    from dockrl.envs.loader import env_class

    with pytest.raises(ValueError, match="names no file"):
        env_class("tools", code="class Env: pass")
