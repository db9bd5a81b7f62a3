"""reward.inline: cheap reward functions run in the caller's process (a thread), the rest keep the process pool's
isolation, and an inline call that hangs is a named error within its timeout."""

import os
import threading

import pytest

from dockrl.rewards import RewardRunner, RewardSpec
from dockrl.rewards.base import is_cheap, resolve_reward_fn
from dockrl.rewards.runner import RewardTimeoutError

PROMPTS = ["What is 40+6?"] * 3
RESPONSES = ["46", "The answer is 46", "45"]
LABELS = [46, 46, 46]


def test_which_functions_are_cheap():
    assert is_cheap(resolve_reward_fn("exact_answer"))
    assert is_cheap(resolve_reward_fn("format"))
    # a configured pattern is the user's regex (it may backtrack for ever): the pool
    assert not is_cheap(resolve_reward_fn("format", {"pattern": r"(a+)+$"}))
    assert not is_cheap(resolve_reward_fn("math_verify"))
    assert not is_cheap(resolve_reward_fn("reward_fixtures:pid_reward"))
    assert is_cheap(resolve_reward_fn("reward_fixtures:cheap_pid_reward"))


def test_cheap_builtins_score_inline_as_the_pool_does():
    specs = [RewardSpec("exact_answer"), RewardSpec("format", weight=0.5)]
    with RewardRunner(specs, num_processes=1) as runner:
        inline = runner.score(PROMPTS, RESPONSES, LABELS)
        assert runner._slots == []  # no pool was started: every call ran here
    # exact: [1, 1, 0]; format (bare number): [1, 0, 1]
    assert inline[0] == [1.5, 1.0, 0.5]
    assert inline[1]["exact_answer/correct"] == [1.0, 1.0, 0.0]
    with RewardRunner(specs, num_processes=1, inline="none") as runner:
        assert runner.score(PROMPTS, RESPONSES, LABELS) == inline
        assert len(runner._slots) == 1


def test_a_user_function_keeps_the_pools_isolation_unless_declared_cheap_or_all_inline():
    """pid_reward scores the process id it ran in: another process by default, this one when it declares itself
    cheap or reward.inline=all."""
    here = float(os.getpid())
    specs = [RewardSpec("reward_fixtures:pid_reward"), RewardSpec("reward_fixtures:cheap_pid_reward")]
    with RewardRunner(specs, num_processes=1) as runner:
        _, components, _ = runner.score(["p"], ["r"], [None])
    assert components["reward_fixtures:pid_reward"][0] != here
    assert components["reward_fixtures:cheap_pid_reward"][0] == here
    with RewardRunner(specs[:1], num_processes=1, inline="all") as runner:
        _, components, _ = runner.score(["p"], ["r"], [None])
        assert runner._slots == []
    assert components["reward_fixtures:pid_reward"][0] == here
    with pytest.raises(ValueError, match="inline must be one of"):
        RewardRunner(specs, inline="some")


def test_an_inline_call_that_hangs_is_a_named_error_within_its_timeout():
    spec = RewardSpec("reward_fixtures:cheap_but_hangs", kwargs={"seconds": 600.0})
    with RewardRunner([spec], timeout_s=0.2, num_processes=1) as runner:
        assert runner.score(["p"], ["fine"], [None])[0] == [1.0]
        done = threading.Event()
        raised: list[BaseException] = []

        def score():
            try:
                runner.score(["p", "p"], ["fine", "hang"], [None, None])
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                raised.append(exc)
            done.set()

        threading.Thread(target=score, daemon=True).start()
        # bounded: far below the call's 600 s (a wait without the deadline would not return in this)
        assert done.wait(60.0), "an inline call past its timeout must not hang the scoring"
    assert len(raised) == 1 and isinstance(raised[0], RewardTimeoutError)
    assert "'reward_fixtures:cheap_but_hangs' ran inline" in str(raised[0])
    assert "reward.timeout_s=0.2" in str(raised[0]) and "sample 1" in str(raised[0])
