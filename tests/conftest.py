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


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Every test module starts on one torch thread, whatever a module before it set (tiny ops on 2 shared
    cores: OpenMP threads spin against each other, one thread is up to 40x faster); a test that needs more
    sets them itself, and the count in force before the module comes back after it."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


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


@pytest.fixture(scope="module")
def ppo_args(tmp_path_factory, tiny_model, arithmetic_data, ray_session):
    """The fault tests' PPO run (tests/fault_runs.py): its root and `dockrl` arguments; every worker kind
    exists in it (actor, critic, reward, reward model, the dock's warehouse and controller)."""
    from dockrl.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("faults")
    reward_model = make_tiny(
        root / "rm", family="qwen2", hidden_size=64, num_layers=2, seed=1, reward_model=True
    )
    from fault_runs import CONFIG
    from runs import write_config

    config = write_config(root / "ppo.yaml", CONFIG)
    return root, [
        "train",
        str(config),
        f"model.path={tiny_model}",
        f"reward.model.path={reward_model}",
        f"data.train_path={arithmetic_data['train']}",
        f"run.output_dir={root}",
    ]


# Test tiers are folders (each also sets its marker, so `-m` selects the same tests):
#   unit/         one process, no Ray: numbers against hand-computed values, parity, configs, the dock's logic
#   distributed/  real processes: gloo ranks (spawned), Ray actors (the session's Ray), subprocesses
#   e2e/          whole runs (`dockrl train` in-process or through the console script): training, resume, faults
#   slow/, faults/, vllm/   CI only: the demos learn, the fault matrix, the vLLM backend (its own venv)
# `make test` runs unit, distributed and e2e (pyproject's testpaths); a new test goes in the folder of its tier.
TIERS = ("unit", "distributed", "e2e", "slow", "faults", "vllm")


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        tier = os.path.relpath(str(item.path), root).split(os.sep)[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
