"""The reward runner's worker processes: results equal the inline ones, per-call timeouts, warm-up outside the timeout, errors scored 0, a dead worker replaced, file-given functions shipped."""

import logging
import sys
import time

import pytest

from dockrl.rewards import (
    RewardRunner,
    RewardSpec,
    resolve_reward_fn,
)

PROMPTS = ["What is 40+6?"] * 3


RESPONSES = ["46", "The answer is 46", "45"]


LABELS = [46, 46, 46]


def _check_weighted(runner):
    totals, components, stats = runner.score(PROMPTS, RESPONSES, LABELS)
    # exact: [1, 1, 0]; format (bare number): [1, 0, 1]; total = 1 * exact + 0.5 * format
    assert totals == [1.5, 1.0, 0.5]
    assert components == {
        "exact_answer": [1.0, 1.0, 0.0],
        "exact_answer/correct": [1.0, 1.0, 0.0],
        "format": [1.0, 0.0, 1.0],
    }
    assert stats == {"timeouts": 0, "errors": 0, "failed": []}


MY_REWARD = '''
from dockrl.rewards import RewardResult


def fn(prompt, response, label):
    """1 for a response of even length, and the length as a component."""
    return RewardResult(float(len(response) % 2 == 0), {"length": float(len(response))})
'''


def test_runner_in_processes_matches_inline_and_handles_user_results():
    specs = [
        RewardSpec("exact_answer"),
        RewardSpec("format", weight=0.5),
    ]
    with RewardRunner(specs, num_processes=2, inline="none") as runner:  # the built-ins through the pool
        _check_weighted(runner)
        _check_weighted(runner)  # the pool is reused
    with RewardRunner([RewardSpec("reward_fixtures:parity_reward", weight=2.0)], num_processes=1) as runner:
        totals, components, _ = runner.score(["p", "p"], ["ab", "abc"], [None, None])
    assert totals == [2.0, 0.0]
    assert components["reward_fixtures:parity_reward/even"] == [1.0, 0.0]
    assert components["reward_fixtures:parity_reward/length"] == [2.0, 3.0]


def test_worker_warmup_does_not_count_against_the_timeout():
    # math-verify's first call in a fresh process takes ~1 s (sympy, LaTeX grammar); the worker warms it
    # up at start-up, so a tight per-call timeout still passes.
    with RewardRunner([RewardSpec("math_verify")], timeout_s=0.5, num_processes=1) as runner:
        totals, _, stats = runner.score(["p"] * 2, ["$\\frac{1}{2}$", "3"], ["0.5", "2"])
    assert totals == [1.0, 0.0]
    assert stats == {"timeouts": 0, "errors": 0, "failed": []}


def test_hung_call_times_out_and_next_calls_work():
    with RewardRunner([RewardSpec("reward_fixtures:sleepy_reward")], timeout_s=0.5) as runner:
        begin = time.monotonic()
        totals, components, stats = runner.score(["p"] * 3, ["ok", "hang", "ok"], [None] * 3)
        elapsed = time.monotonic() - begin
        assert totals == [1.0, 0.0, 1.0]
        assert stats == {"timeouts": 1, "errors": 0, "failed": [1]}  # the failed sample, by index
        assert elapsed < 10.0  # far below the 30 s sleep
        totals, _, stats = runner.score(["p"], ["ok"], [None])
        assert totals == [1.0] and stats == {"timeouts": 0, "errors": 0, "failed": []}


def test_errors_score_zero_and_log_once(caplog):
    with caplog.at_level(logging.WARNING, logger="dockrl.rewards.runner"):
        with RewardRunner([RewardSpec("reward_fixtures:failing_reward")], num_processes=1) as runner:
            totals, _, stats = runner.score(["p"] * 3, ["boom", "fine", "boom"], [None] * 3)
    assert totals == [0.0, 1.0, 0.0]
    assert stats == {"timeouts": 0, "errors": 2, "failed": [0, 2]}
    logged = [r for r in caplog.records if "failing_reward" in r.getMessage()]
    assert len(logged) == 1 and "verifier exploded" in logged[0].getMessage()


@pytest.mark.skipif(sys.platform == "win32", reason="posix process semantics")
def test_worker_that_dies_is_replaced():
    with RewardRunner([RewardSpec("reward_fixtures:dying_reward")], num_processes=1) as runner:
        totals, _, stats = runner.score(["p"] * 3, ["ok", "die", "ok"], [None] * 3)
        assert totals == [1.0, 0.0, 1.0]
        assert stats == {"timeouts": 0, "errors": 1, "failed": [1]}
        assert runner.score(["p"], ["ok"], [None])[0] == [1.0]


def test_a_file_given_function_is_found_read_and_shipped(tmp_path, monkeypatch):
    """`./my_reward.py:fn` next to the config (or `my_reward:fn`, a module file there) is read when the
    config loads; the reward processes run it from the shipped source, so the file may be gone by then."""
    from dockrl.config import TrainConfig, load_config
    from dockrl.config.fields import ConfigError

    configs, elsewhere = tmp_path / "configs", tmp_path / "elsewhere"
    configs.mkdir()
    elsewhere.mkdir()
    (configs / "my_reward.py").write_text(MY_REWARD)
    (configs / "run.yaml").write_text(
        "reward: {functions: [{name: ./my_reward.py:fn}, {name: 'my_reward:fn'}]}\n"
    )
    monkeypatch.chdir(elsewhere)  # neither the working directory nor PYTHONPATH holds the file
    base = ["model.path=m", "data.train_path=d.jsonl", "run.steps=1", "run.prompts_per_step=1"]
    cfg = load_config(TrainConfig, configs / "run.yaml", base)
    for function in cfg.reward.functions:
        assert function.source_file == str(configs / "my_reward.py") and function.code == MY_REWARD
    (configs / "my_reward.py").unlink()
    specs = [RewardSpec(f.name, code=f.code, origin=f.source_file) for f in cfg.reward.functions]
    with RewardRunner(specs[:1], num_processes=1) as runner:
        totals, components, _ = runner.score(["p", "p"], ["ab", "abc"], [None, None])
    assert totals == [1.0, 0.0] and components["./my_reward.py:fn/length"] == [2.0, 3.0]
    assert (
        resolve_reward_fn(specs[1].name, code=specs[1].code, origin=specs[1].origin)("p", "abcd", None).score
        == 1.0
    )
    # A path that is nowhere, and a file that fails to import, are errors naming the file.
    (configs / "run.yaml").write_text("reward: {functions: [{name: ./missing.py:fn}]}\n")
    with pytest.raises(
        ConfigError, match=r"reward.functions\[0\].name='./missing.py:fn': .*no file './missing.py'"
    ):
        load_config(TrainConfig, configs / "run.yaml", base)
    with pytest.raises(ValueError, match=r"importing /x/bad.py failed: ZeroDivisionError"):
        resolve_reward_fn("/x/bad.py:fn", code="1 / 0\n", origin="/x/bad.py")
