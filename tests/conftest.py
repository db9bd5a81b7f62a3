"""Shared test fixtures: one Ray runtime per test session, tiny model directories built on demand."""

import os

import pytest
import torch

# Tiny ops on 2 shared cores run far faster single-threaded (thread hand-off dominates the math).
torch.set_num_threads(1)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray workers (and the reward processes they spawn) import user reward functions from tests/.
_tests_dir = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_tests_dir, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def ray_session():
    """Start one local Ray runtime for the whole test session (ray.init costs ~2.5 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # never join a cluster some other process left running on this machine
            num_cpus=4,
            resources={"test_pool": 1.0},  # a custom node resource, as placement.* names them
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",
        )
    yield ray
    # Left running on purpose: pytest exits right after, and shutdown + re-init per module costs seconds.


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random qwen2-family model + tokenizer directory (built once per session)."""
    from dockrl.models.tiny import make_tiny

    return make_tiny(
        tmp_path_factory.mktemp("tiny") / "model", family="qwen2", hidden_size=64, num_layers=2, seed=0
    )


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory):
    """train.jsonl / test.jsonl of the synthetic arithmetic task."""
    from dockrl.data.synthetic import write_task

    return write_task("arithmetic", tmp_path_factory.mktemp("data"), num_train=256, num_test=32, seed=0)


# Test tiers (markers; `make test-fast` runs the unit tier):
#   unit         one process, no Ray: numbers against hand-computed values, parity, configs, the dock's logic
#   distributed  real processes: gloo ranks (spawned) or Ray actors (the session's Ray)
#   e2e          whole runs through the CLI (and the scripts): training, resume, faults
# A test's tier follows from what it uses, so no test file has to repeat it.
_SPAWNING = {"test_dp_equivalence", "test_tp_equivalence", "test_reshard_switch", "test_sharded_load"}
_SPAWNING |= {"test_collective_devices", "test_netem"}
_END_TO_END = {"test_e2e_grpo", "test_e2e_algos", "test_resume", "test_faults", "test_gpu_check", "test_demo"}
_END_TO_END |= {"test_emulated_train"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if module in _END_TO_END or "through_cli" in item.name:
            item.add_marker(pytest.mark.e2e)
        elif module in _SPAWNING or "ray_session" in item.fixturenames:
            item.add_marker(pytest.mark.distributed)
        else:
            item.add_marker(pytest.mark.unit)
