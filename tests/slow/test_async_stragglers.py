"""Stragglers in an asynchronous run (make test-slow): random processes paused at random stages change no staleness bound and no number."""

import hypothesis
import pytest
from hypothesis import strategies as st

import async_runs
from dockrl.cli import main
from runs import computed_metrics, metric_differences

two_ahead = pytest.fixture(scope="module")(async_runs.two_ahead)


_PAUSABLE = [  # (process, a stage the driver starts): stragglers anywhere in the pipeline
    ("rollout-0", "generate"),
    ("rollout-1", "receive_weights"),
    ("reward-0", "score"),
    ("actor-0", "update"),
    ("actor-1", "compute_ref"),
    ("dockrl-warehouse-1", "generate"),
]


@hypothesis.settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(
    pauses=st.lists(
        st.tuples(st.sampled_from(_PAUSABLE), st.integers(1, 4), st.sampled_from([0.2, 0.7, 1.5])),
        min_size=1,
        max_size=3,
        unique_by=lambda p: (p[0], p[1]),
    )
)
def test_stragglers_change_no_staleness_and_no_number(two_ahead, pauses):
    """Random processes paused (SIGSTOP, then SIGCONT seconds later) at random stages and steps: which weights
    generate which step is fixed by the step number, so the staleness stays within rollout.max_staleness=2
    and the run computes the undisturbed run's numbers bit for bit."""
    import os

    root, whole, base = two_ahead
    spec = ";".join(f"pause={s}:{who}:{stage}:{step}" for (who, stage), step, s in pauses)
    name = f"paused-{len(list(root.glob('paused-*')))}"
    os.environ["DOCKRL_FAULTS"] = spec
    try:
        assert main([*base, f"run.name={name}"]) == 0
    finally:
        del os.environ["DOCKRL_FAULTS"]
    paused = computed_metrics(root / name)
    assert max(r["async/staleness_max"] for r in paused) <= 2
    assert paused == whole, (spec, metric_differences(paused, whole))
