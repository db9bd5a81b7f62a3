"""The `local` policy (dockrl.dock.locality): rows held on the caller's node first, bins cut by node (no Ray).

Each check is run beside the same request under `first`, which ignores where rows live, so a broken locality
would show as `first`'s answer.
"""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dockrl.dock import DockController
from dockrl.dock.locality import local_partition
from dockrl.dock.shared import SharedController

RESPONSE = ["response_ids"]


def placed(policy: str, homes: list[int], lengths: list[int], group_size: int = 1) -> DockController:
    """A table whose row i's response (of lengths[i] tokens) lives on warehouse homes[i]."""
    controller = SharedController(max(homes) + 1, policy=policy)
    controller.add_groups([group_size] * (len(homes) // group_size), [2] * (len(homes) // group_size))
    for warehouse in sorted(set(homes)):
        rows = [r for r, home in enumerate(homes) if home == warehouse]
        controller.mark_ready(warehouse, rows, RESPONSE, {"response_len": [lengths[r] for r in rows]})
    return controller


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 3)), min_size=1, max_size=40),
    num_bins=st.integers(1, 5),
)
def test_local_partition_keeps_balanced_partitions_promise(rows, num_bins):
    tokens, homes = (np.asarray(column) for column in zip(*rows))
    bins = local_partition(tokens, homes, num_bins)
    assert sorted(np.concatenate(bins).tolist()) == list(range(len(tokens)))
    sizes = [b.size for b in bins]
    assert max(sizes) - min(sizes) <= 1
    loads = [int(tokens[b].sum()) for b in bins]
    assert max(loads) - min(loads) <= tokens.max()


def test_local_partition_gives_each_warehouse_its_own_bin_when_their_shares_balance():
    homes = np.repeat([2, 0, 1], 4)  # 4 rows per warehouse, listed out of order
    tokens = np.array([50, 10, 30, 10, 40, 20, 20, 20, 10, 30, 30, 30])  # 100 tokens per warehouse
    bins = local_partition(tokens, homes, 3)
    assert [sorted(set(homes[b].tolist())) for b in bins] == [[0], [1], [2]]  # ordered by warehouse


def test_local_partition_swaps_rows_across_warehouses_only_to_balance():
    homes = np.array([0, 0, 1, 1])
    tokens = np.array([100, 100, 1, 1])  # home bins would be 200 against 2: over the longest row
    bins = local_partition(tokens, homes, 2)
    assert [int(tokens[b].sum()) for b in bins] == [101, 101]


@pytest.mark.parametrize("policy, expected", [("local", [4, 5]), ("first", [0, 1])])
def test_rows_held_on_the_callers_node_are_served_first(policy, expected):
    controller = placed(policy, homes=[0, 0, 0, 0, 1, 1, 1, 1], lengths=[8] * 8)
    assert controller.allocate("update", RESPONSE, 2, near=[1]).rows == expected
    assert controller.allocate("reward", RESPONSE, 2).rows == [0, 1]  # no node known: lowest rows


@pytest.mark.parametrize("policy, expected", [("local", [4, 5, 6, 7]), ("first", [0, 1, 2, 3])])
def test_whole_groups_held_on_the_callers_node_are_served_first(policy, expected):
    controller = placed(policy, homes=[0, 0, 0, 0, 1, 1, 1, 1], lengths=[8] * 8, group_size=2)
    assert controller.allocate("reward", RESPONSE, 4, whole_groups=True, near=[1]).rows == expected


def test_balanced_bins_go_to_the_caller_whose_node_holds_them():
    homes, lengths = [0, 1, 2] * 4, [10] * 12  # interleaved: `first` mixes every bin over the 3 nodes
    for policy in ("local", "first"):
        controller = placed(policy, homes, lengths)
        served = {
            node: controller.allocate("update", RESPONSE, 4, balance_over=3, near=[node])
            for node in (2, 0, 1)
        }
        local = all(all(homes[r] == node for r in served[node].rows) for node in served)
        assert local == (policy == "local"), (policy, {n: a.rows for n, a in served.items()})
    # with `peer`, bin p is the p-th warehouse's whoever asks first (bit-for-bit runs keep their rows)
    controller = placed("local", homes, lengths)
    assert controller.allocate("update", RESPONSE, 4, balance_over=3, peer=1, near=[0]).rows == [1, 4, 7, 10]


def test_a_put_serves_the_waiter_beside_its_warehouse_first():
    controller = SharedController(2, policy="local")
    controller.add_groups([2, 2], [2, 2])
    results: dict[int, list[int]] = {}

    def wait(node: int) -> None:
        allocation, _ = controller.wait_poll("reward", RESPONSE, 2, 10.0, whole_groups=True, near=[node])
        results[node] = allocation.rows

    waiters = [threading.Thread(target=wait, args=(node,)) for node in (0, 1)]
    for thread in waiters:
        thread.start()
    while len(controller._waiters) < 2:
        threading.Event().wait(0.01)
    controller.mark_ready(1, [2, 3], RESPONSE, {"response_len": [5, 5]})  # group 1, on node 1
    controller.mark_ready(0, [0, 1], RESPONSE, {"response_len": [5, 5]})  # group 0, on node 0
    for thread in waiters:
        thread.join(5)
    assert results == {0: [0, 1], 1: [2, 3]}  # node 0's waiter parked first, yet group 1 went to node 1
