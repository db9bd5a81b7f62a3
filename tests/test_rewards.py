"""rewards/: built-in verifiers on hand-checked cases, name resolution, and the process-pool runner."""

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from dockrl.rewards import (
    RewardResult,
    RewardRunner,
    RewardSpec,
    exact_answer,
    format_reward,
    math_verify_reward,
    resolve_reward_fn,
)

# ---------------------------------------------------------------- exact_answer


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("The answer is 46", 46, 1.0),
        ("The answer is 46.", "46", 1.0),  # sentence period is not a decimal point
        ("I think it is 45", 46, 0.0),
        ("so we get \\boxed{-3}", "-3", 1.0),
        ("\\boxed{12} and later I mention 13", "12", 1.0),  # the box wins over the last number
        ("$\\boxed{ 7 }$", 7, 1.0),
        ("4.50", "4.5", 1.0),  # numeric, not string, comparison
        ("5-3=2", 2, 1.0),  # '-3' glued to a digit is subtraction, last number is 2
        ("10 - 12 = -2", -2, 1.0),
        ("it is 1,000", 1000, 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces, string comparison
        ("no number here", 3, 0.0),
        ("", 0, 0.0),
        ("\\boxed{4", "4", 1.0),  # cut-off box is ignored; falls back to the last number
    ],
)
def test_exact_answer(response, label, expected):
    result = exact_answer("What is ...?", response, label)
    assert result.score == expected
    assert result.components == {"correct": expected}


# ---------------------------------------------------------------- math_verify


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("0.5", "\\frac{1}{2}", 1.0),
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("The answer is $\\boxed{2}$", "2", 1.0),
        ("$\\boxed{3}$", "2", 0.0),
        ("I don't know", "2", 0.0),
        ("The answer is $x^2+1$", "x^2+1", 1.0),  # bare LaTeX labels are read as math, not text
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),
    ],
)
def test_math_verify(response, label, expected):
    assert math_verify_reward("", response, label).score == expected


def test_math_verify_works_off_the_main_thread():
    # math-verify's own signal.alarm timeouts raise ValueError off the main thread; ours turns them off there.
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(math_verify_reward, "", "$\\frac{2}{4}$", "0.5").result()
    assert result.score == 1.0


# ---------------------------------------------------------------- format


def test_format_reward_default_and_custom_pattern():
    assert format_reward("", "42", None).score == 1.0
    assert format_reward("", " -3.5 \n", None).score == 1.0
    assert format_reward("", "The answer is 42", None).score == 0.0
    boxed = resolve_reward_fn("format", {"pattern": r".*\\boxed\{.+\}.*"})
    assert boxed("", "line one\nso \\boxed{4}\nend", None).score == 1.0  # DOTALL spans lines
    assert boxed("", "4", None).score == 0.0


# ---------------------------------------------------------------- resolution


def test_resolve_builtin_and_module_function():
    assert resolve_reward_fn("exact_answer") is exact_answer
    scaled = resolve_reward_fn("reward_fixtures:length_reward", {"scale": 2.0})
    assert scaled("p", "abc", None) == 6.0


def test_resolve_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown reward function 'exact'.*'exact_answer'.*'format'"):
        resolve_reward_fn("exact")
    with pytest.raises(ValueError, match=r"'no_such_pkg\.mod'.*ModuleNotFoundError"):
        resolve_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match=r"has no attribute 'missing'.*length_reward"):
        resolve_reward_fn("reward_fixtures:missing")
    with pytest.raises(ValueError, match="not a callable"):
        resolve_reward_fn("reward_fixtures:NOT_CALLABLE")
    with pytest.raises(ValueError, match="'scal'"):
        resolve_reward_fn("reward_fixtures:length_reward", {"scal": 2.0})
    with pytest.raises(ValueError, match="package.module:function"):
        resolve_reward_fn("reward_fixtures:")


# ---------------------------------------------------------------- runner


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


def test_runner_weights_combine_inline():
    runner = RewardRunner([RewardSpec("exact_answer"), RewardSpec("format", weight=0.5)], num_processes=0)
    _check_weighted(runner)


def test_runner_in_processes_matches_inline_and_handles_user_results():
    specs = [
        RewardSpec("exact_answer"),
        RewardSpec("format", weight=0.5),
    ]
    with RewardRunner(specs, num_processes=2) as runner:
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


def test_inline_errors_and_bad_return_types_count_as_errors():
    runner = RewardRunner([RewardSpec("reward_fixtures:failing_reward")], num_processes=0)
    assert runner.score(["p", "p"], ["boom", "ok"], [None, None])[2] == {
        "timeouts": 0,
        "errors": 1,
        "failed": [0],
    }


@pytest.mark.skipif(sys.platform == "win32", reason="posix process semantics")
def test_worker_that_dies_is_replaced():
    with RewardRunner([RewardSpec("reward_fixtures:dying_reward")], num_processes=1) as runner:
        totals, _, stats = runner.score(["p"] * 3, ["ok", "die", "ok"], [None] * 3)
        assert totals == [1.0, 0.0, 1.0]
        assert stats == {"timeouts": 0, "errors": 1, "failed": [1]}
        assert runner.score(["p"], ["ok"], [None])[0] == [1.0]


def test_runner_config_errors():
    with pytest.raises(ValueError, match="unique"):
        RewardRunner([RewardSpec("format"), RewardSpec("format", kwargs={"pattern": "x"})])
    with pytest.raises(ValueError, match="unknown reward function"):
        RewardRunner([RewardSpec("nope")])
    with pytest.raises(ValueError, match="equal lengths"):
        RewardRunner([RewardSpec("format")], num_processes=0).score(["p"], [], [])


def test_reward_result_default_components():
    assert RewardResult(1.0).components == {}


# ---------------------------------------------------------------- reward functions from files

MY_REWARD = '''
from dockrl.rewards import RewardResult


def fn(prompt, response, label):
    """1 for a response of even length, and the length as a component."""
    return RewardResult(float(len(response) % 2 == 0), {"length": float(len(response))})
'''


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


@pytest.mark.parametrize("name", ["exact_answer", "os.path:join", "my_reward:fn"])
def test_code_runs_only_for_a_file_reference(name, tmp_path, monkeypatch):
    """A config whose `code` stands next to a built-in, an importable module, or a module name with no file it
    was read from is refused before anything runs: the code would write a marker file."""
    from dockrl.config import TrainConfig, load_config
    from dockrl.config.fields import ConfigError

    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()\ndef fn(prompt, response, label):\n    return 1.0\n"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"reward": {"functions": [{"name": name, "code": code}]}}))
    monkeypatch.chdir(tmp_path)
    base = ["model.path=m", "data.train_path=d.jsonl", "run.steps=1", "run.prompts_per_step=1"]
    with pytest.raises(
        ConfigError, match=r"reward.functions\[0\].code: set with name=.*not a file reference"
    ):
        load_config(TrainConfig, config, base)
    with pytest.raises(ValueError, match="runs only for a file reference"):
        resolve_reward_fn(name, code=code)
    assert not marker.exists()
    # The same code under a file reference runs (a saved run's config.yaml on resume).
    assert resolve_reward_fn("./my_reward.py:fn", code=code, origin=str(tmp_path / "my_reward.py"))(
        "p", "r", None
    )
    assert marker.exists()
