"""WorkerGroup: per-rank calls, and a dead, raising or hung worker becomes an error naming it."""

import sys
import time

import pytest
import ray

from dockrl.workers.group import WorkerError, WorkerGroup
from echo_worker import EchoWorker
from runs import tiny_paths

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def group(ray_session):
    g = WorkerGroup(EchoWorker, 2, name=f"echo{time.monotonic_ns()}", timeout_s=5.0, distributed=True)
    yield g
    g.shutdown()


def test_call_and_collective(group):
    assert group.call("rank_times", 3) == [0, 3]
    assert group.call("all_reduce") == [3.0, 3.0]


def test_raising_worker_is_named(group):
    with pytest.raises(WorkerError, match=r"(?s)-1 raised:.*verifier exploded"):
        group.call("boom")


def test_dead_worker_is_named_quickly(group):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker echo\d+-1 died"):
        group.call("die")
    assert time.monotonic() - start < 30


def test_hung_worker_times_out_with_names(group):
    with pytest.raises(WorkerError, match=r"no answer from echo\d+-0, echo\d+-1 after 5 s"):
        group.call("sleep", 60)


@pytest.mark.parametrize("setting", [1, 2])
def test_a_rank_runs_run_threads_per_rank_torch_threads(ray_session, tiny_model, arithmetic_data, setting):
    """run.threads_per_rank=N: the count recipes/cluster.py gives a trainer group reaches its worker process."""
    from dockrl.config import TrainConfig, load_config
    from dockrl.recipes.cluster import threads_per_rank

    base = [
        *tiny_paths(tiny_model, arithmetic_data),
        "run.steps=1",
        "run.prompts_per_step=2",
        "run.device=cpu",
    ]
    cfg = load_config(TrainConfig, None, [*base, f"run.threads_per_rank={setting}"])
    # Auto would give each of 2 ranks cores // 2 threads: on any machine 1 or 2 differs from it.
    g = WorkerGroup(
        EchoWorker,
        2,
        name=f"threads{time.monotonic_ns()}",
        timeout_s=30.0,
        init_kwargs={"num_threads": threads_per_rank(cfg, 2)},
    )
    try:
        assert g.call("torch_threads") == [setting, setting]
    finally:
        g.shutdown()


def test_ranks_take_a_share_of_the_named_node_resource(ray_session):
    """placement.*: each rank asks for PLACEMENT_SHARE of its node resource, so it runs only on a node offering
    it, and any number of ranks fit there."""
    from dockrl.workers.group import PLACEMENT_SHARE

    before = ray.available_resources()["test_pool"]
    g = WorkerGroup(
        EchoWorker, 3, name=f"placed{time.monotonic_ns()}", timeout_s=30.0, node_resources=["test_pool"]
    )
    try:
        assert g.call("rank_times", 2) == [0, 2, 4]
        held = before - ray.available_resources().get("test_pool", 0.0)
        assert held == pytest.approx(3 * PLACEMENT_SHARE, abs=1e-9)  # Ray counts resources in 1e-4 units
    finally:
        g.shutdown()


def test_placement_naming_a_resource_no_node_offers_is_a_config_error(
    ray_session, tiny_model, arithmetic_data
):
    from dockrl.config import ConfigError, TrainConfig, load_config
    from dockrl.recipes.cluster import check_placement

    base = [*tiny_paths(tiny_model, arithmetic_data)]
    base += ["run.steps=1", "run.prompts_per_step=2"]
    check_placement(load_config(TrainConfig, None, [*base, "placement.actor=[test_pool]"]))
    cfg = load_config(TrainConfig, None, [*base, "placement.actor=[test_pool]", "placement.reward=[node7]"])
    with pytest.raises(
        ConfigError, match=r"placement.reward=\['node7'\]: no node of the Ray cluster offers the "
    ):
        check_placement(cfg)
