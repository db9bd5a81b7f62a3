"""A step's metrics from a hand-built StepRecord (recipes/step_metrics.py), against hand-computed values; and
the schedule a config resolves to (config/schedule.py). No Ray, no dock, no model."""

import math

import pytest

from dockrl.config.loader import load_config
from dockrl.config.schedule import Schedule, schedule_of
from dockrl.config.schema import TrainConfig
from dockrl.observe import metric_names as names
from dockrl.recipes.common import EncodedPrompt
from dockrl.recipes.step_metrics import SamplingCounts, StepRecord, describe, step_metrics
from dockrl.workers.results import GenerateResult, ScoreResult, UpdateResult

# A handful of float64 operations on small numbers: a few units in the last place at most.
REL = 1e-12


def _record(**changes) -> StepRecord:
    """Step 5: 2 prompts (3 and 5 tokens) x 2 samples; 2 rollout ranks, 2 reward workers, 2 actor ranks."""
    fields = dict(
        step=5,
        batch=[EncodedPrompt([1, 2, 3], "a", "1", 0), EncodedPrompt([1, 2, 3, 4, 5], "b", "2", 1)],
        generated=[
            GenerateResult([4, 6], truncated=1, reshard_s=0.5, interrupted=[1], continued=2),
            GenerateResult([2, 8], truncated=0, reshard_s=0.25, busy_s=3.0, continued=1),
        ],
        scored=[
            ScoreResult(
                [1.0, 0.0], [0, 1], correct=[1.0, 0.0], versions=[3, 4], timeouts=1, samples=[{"r": 1}]
            ),
            ScoreResult(
                [0.5, 0.5], [2, 3], correct=[1.0, 1.0], overlong=[0.0, -0.5], versions=[4, 4], errors=2
            ),
        ],
        # metrics are all-reduced across ranks: the first rank's are the group's
        updates=[UpdateResult({"loss": 0.1, "rollout/kl": 0.01}), UpdateResult({"loss": 99.0})],
        timings={"rollout": 2.0, "reward": 2.5, "reference": 1.0, "update": 4.0, "step": 10.0},
        dock_stats={
            "mode": "dock",
            "warehouses": [
                {"bytes": 100, "bytes_in": 40, "bytes_out": 60},
                {"bytes": 50, "bytes_in": 10, "bytes_out": 5},
            ],
            "client": {"bytes_put": 7, "bytes_got": 3},
            "latency_ms": {"allocate": {"p99_ms": 1.5, "p50_ms": 0.5}},
        },
    )
    return StepRecord(**{**fields, **changes})


def test_metrics_of_a_small_async_partial_record_are_the_hand_computed_ones():
    m = step_metrics(_record(), samples_per_prompt=2, staleness=True, partial=True)
    # prompt tokens: (3 + 5) x 2 samples = 16; responses 4 + 6 + 2 + 8 = 20; the step's tokens 36
    expected = {
        # rewards 1, 0, 0.5, 0.5: mean 0.5, population variance (0.25 + 0.25) / 4
        "reward/mean": 0.5,
        "reward/std": math.sqrt(0.125),
        "reward/min": 0.0,
        "reward/max": 1.0,
        # lengths 4, 6, 2, 8: mean 5, variance (1 + 1 + 9 + 9) / 4 = 5
        "response_length/mean": 5.0,
        "response_length/std": math.sqrt(5.0),
        "response_length/min": 2.0,
        "response_length/max": 8.0,
        "response_length/truncated_frac": 1 / 4,
        "train/accuracy": 3 / 4,
        "reward/overlong_penalty": -0.25,  # mean of 0, -0.5 (only the second worker shapes)
        "reward/overlong_frac": 1 / 2,
        "reward/timeouts": 1.0,
        "reward/errors": 2.0,
        "reward/dropped_groups": 0.0,
        "actor/loss": 0.1,  # a key without a section is the actor's
        "rollout/kl": 0.01,
        "timing/rollout": 2.0,
        "timing/reward": 2.5,
        "timing/reference": 1.0,
        "timing/update": 4.0,
        "timing/step": 10.0,
        "timing/reshard_to_rollout": 0.5,  # the slowest rank's
        "timing/rollout_busy": 3.0,
        "throughput/tokens_per_s": 36 / 10,
        "throughput/rollout_tokens_per_s": 20 / 2,
        "throughput/update_tokens_per_s": 36 / 4,
        "throughput/reference_tokens_per_s": 36 / 1,
        "dock/bytes_in_warehouses": 150.0,
        "dock/bytes_moved": 40 + 60 + 10 + 5.0,
        "dock/driver_bytes": 7 + 3.0,  # the driver client's puts and gets
        "dock/allocate_p99_ms": 1.5,
        "dock/rows": 4.0,
        # step 5 trains with the weights after update 4: versions 3, 4, 4, 4 are 1, 0, 0, 0 behind
        "async/staleness_mean": 0.25,
        "async/staleness_max": 1.0,
        "rollout/interrupted": 1.0,
        "rollout/continued": 3.0,
        "tokens/prompt": 16.0,
        "tokens/response": 20.0,
    }
    assert m == pytest.approx(expected, rel=REL, abs=0)
    assert list(m) == list(expected)  # the order the loggers see


def test_a_sync_record_has_no_staleness_or_partial_figures_and_adds_dapo_and_critic_ones():
    record = _record(
        timings={"rollout": 2.0, "update": 4.0, "step": 8.0},
        updates=[],  # ppo's warm-up: the actor did not update
        critic_updates=[UpdateResult({"critic/value_loss": 0.3, "reward/kl_coef": 0.02})],
        sampling=SamplingCounts(
            rounds=2, generated_groups=3, informative_groups=1, filled_groups=1, dropped_groups=1
        ),
    )
    m = step_metrics(record, samples_per_prompt=2, staleness=False, partial=False)
    assert not any(k.startswith(("async/", "rollout/interrupted", "rollout/continued", "actor/")) for k in m)
    assert names.THROUGHPUT_REFERENCE_TOKENS_PER_S not in m  # no reference stage ran
    assert m[names.THROUGHPUT_TOKENS_PER_S] == pytest.approx(36 / 8, rel=REL)
    assert list(m)[-7:] == [
        "dapo/rounds",
        "dapo/generated_groups",
        "dapo/informative_groups",
        "dapo/filled_groups",
        "dapo/dropped_groups",
        "critic/value_loss",
        "reward/kl_coef",
    ]
    assert [m[k] for k in list(m)[-7:]] == [2.0, 3.0, 1.0, 1.0, 1.0, 0.3, 0.02]


def test_rows_without_rewards_give_no_reward_summary_and_zero_staleness():
    """rollout.partial can cut every group of a step: nothing is scored, reward/mean is absent."""
    record = _record(scored=[ScoreResult()], generated=[GenerateResult([], truncated=0, reshard_s=0.0)])
    m = step_metrics(record, samples_per_prompt=2, staleness=True, partial=True)
    assert names.REWARD_MEAN not in m and names.RESPONSE_LENGTH_MEAN not in m
    assert m[names.RESPONSE_TRUNCATED_FRAC] == 0.0 and m[names.DOCK_ROWS] == 0.0
    assert m[names.STALENESS_MEAN] == 0.0 and m[names.STALENESS_MAX] == 0.0
    assert names.TRAIN_ACCURACY not in m


def test_samples_and_describe():
    assert _record().samples == [{"r": 1}]
    assert describe([], "x") == {}
    assert describe([2.0], "x") == {"x/mean": 2.0, "x/std": 0.0, "x/min": 2.0, "x/max": 2.0}


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        ["model.path=m", "data.train_path=t", "run.steps=1", "run.prompts_per_step=1", *overrides],
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], Schedule("sync", lead=0, dynamic_sampling_rounds=0)),
        (["algo.dynamic_sampling=true", "algo.max_sampling_rounds=4"], Schedule("sync", 0, 4)),
        (["rollout.max_staleness=2", "rollout.placement=separate"], Schedule("async", 2, 0)),
        # partial rollout spends its staleness budget on cuts: the rollout does not run ahead
        (["rollout.partial=true", "rollout.max_staleness=3"], Schedule("partial", 0, 0)),
        (["algo.max_sampling_rounds=4"], Schedule("sync", 0, 0)),  # rounds without dynamic sampling: none
    ],
)
def test_schedule_of(overrides, expected):
    schedule = schedule_of(_cfg(*overrides))
    assert schedule == expected
    assert schedule.off_policy_rows == (expected.kind != "sync")
    assert schedule.partial == (expected.kind == "partial")
