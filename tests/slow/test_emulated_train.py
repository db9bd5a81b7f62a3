"""A 2-step GRPO run across an emulated 3-node cluster (bench/netem.py: a network namespace and a 200 mbit link
per node), in dock mode and in driver mode: actor ranks on nodes 1 and 2, the reward worker and the driver on
node 0, a warehouse on each node. Slow (about a minute); `make test-slow` runs it. Needs root, ip and tc."""

import argparse

import pytest

from dockrl.bench.netem import unavailable

REASON = unavailable()
if REASON is not None:
    pytest.skip(f"no emulated cluster here: {REASON}", allow_module_level=True)


@pytest.mark.slow
def test_grpo_across_an_emulated_cluster_in_dock_and_driver_mode():
    from dockrl.bench.cluster_train import run

    args = argparse.Namespace(
        emulate_nodes=3,
        link_mbit=200.0,
        modes="dock,driver",
        steps=2,
        config=None,
        timeout_s=600.0,
        overrides=[],
    )
    dock, driver = run(args)
    assert (dock["mode"], driver["mode"]) == ("dock", "driver")
    for row in (dock, driver):
        ips = row["node_ips"]
        assert row["steps"] == 2
        assert row["worker_nodes"] == {"actor-0": ips[1], "actor-1": ips[2], "reward-0": ips[0]}
    # The same seed trains the same numbers whichever way the rows travel.
    assert dock["reward_mean"] == driver["reward_mean"]
    assert dock["dock_bytes_moved"] == driver["dock_bytes_moved"]
    # Driver mode carries every byte the dock moves; dock mode only the prompts and labels it adds.
    assert driver["driver_bytes"] == driver["dock_bytes_moved"]
    assert 0 < dock["driver_bytes"] < driver["driver_bytes"] / 10
