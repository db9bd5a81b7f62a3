"""rewards/: built-in verifiers on hand-checked cases, name resolution, and the process-pool runner."""

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


def test_inline_errors_and_bad_return_types_count_as_errors():
    runner = RewardRunner([RewardSpec("reward_fixtures:failing_reward")], num_processes=0)
    assert runner.score(["p", "p"], ["boom", "ok"], [None, None])[2] == {
        "timeouts": 0,
        "errors": 1,
        "failed": [0],
    }


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


def test_overlong_shaping_counts_a_trajectorys_sampled_tokens_not_its_observations():
    """Two two-turn trajectories, 8 + 8 sampled tokens around a 30-token observation (46 in all), policy budget
    2 x 10 = 20, buffer 4: the sampled 16 are inside the budget's soft band's start (20 - 4 = 16): no penalty.
    Counted whole (the response's 46 tokens against 20, as before), each took the full penalty of 1."""
    import torch

    from dockrl.rewards.terms import OverlongPenalty, ScoredGroups

    mask = torch.tensor([1.0] * 8 + [0.0] * 30 + [1.0] * 8)
    batch = {"response_ids": [torch.zeros(46, dtype=torch.long)] * 2, "loss_mask": [mask, mask]}
    masked = ScoredGroups(batch, ["p", "p"], ["r", "r"], group_size=2)
    OverlongPenalty(20, 4, 1.0, masked=True).apply(masked)
    assert masked.scores == [0.0, 0.0]
    whole = ScoredGroups(batch, ["p", "p"], ["r", "r"], group_size=2)
    OverlongPenalty(20, 4, 1.0).apply(whole)
    assert whole.scores == [-1.0, -1.0]
    # a trajectory that sampled 18 of its budget's 20 sits halfway into the buffer
    longer = torch.tensor([1.0] * 10 + [0.0] * 30 + [1.0] * 8)
    half = ScoredGroups({"response_ids": [None], "loss_mask": [longer]}, ["p"], ["r"], group_size=1)
    OverlongPenalty(20, 4, 1.0, masked=True).apply(half)
    assert half.scores == [-0.5]
