"""Shared test fixtures: one Ray runtime per test session, tiny model directories built on demand."""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_session():
    """Start one local Ray runtime for the whole test session (ray.init costs ~2.5 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",
        )
    yield ray
    # Left running on purpose: pytest exits right after, and shutdown + re-init per module costs seconds.
