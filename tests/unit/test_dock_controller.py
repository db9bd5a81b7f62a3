"""DockController and Warehouse without Ray: allocation semantics, exactly-once, tails, metadata."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockrl.dock import DockController, DockError, Warehouse

COLS = ["response_ids", "reward"]


def table(num_groups: int, group_size: int, num_warehouses: int = 2) -> DockController:
    controller = DockController(num_warehouses)
    controller.add_groups([group_size] * num_groups, [3 + g for g in range(num_groups)])
    return controller


def ready(controller: DockController, rows, columns=COLS, warehouse: int = 0) -> None:
    controller.mark_ready(warehouse, list(rows), columns)


def test_add_groups_returns_all_contiguous_row_ids_and_prompt_lens():
    controller = DockController(1)
    assert controller.add_groups([2, 3], [5, 7]) == [0, 1, 2, 3, 4]
    assert controller.add_groups([1], [9]) == [5]
    assert controller.num_rows() == 6
    assert controller.group_sizes() == [2, 3, 1]
    assert controller.lengths([0, 1, 2, 4, 5], ["prompt_len"]) == {"prompt_len": [5, 5, 7, 7, 9]}


def test_allocate_serves_only_rows_with_all_columns_ready_lowest_first():
    controller = table(4, 2)
    ready(controller, [5, 1, 3, 6], ["response_ids"])
    ready(controller, [1, 3, 5], ["reward"])
    assert controller.allocate("c", COLS, 8) is None  # 3 fully ready < min_count 8
    allocation = controller.allocate("c", COLS, 2)
    assert allocation.rows == [1, 3]
    allocation = controller.allocate("c", COLS, 2, min_count=1)
    assert allocation.rows == [5]
    assert controller.allocate("c", COLS, 1) is None  # row 6 lacks reward; 0, 2, 4, 7 lack both


def test_exactly_once_per_consumer_and_consumers_independent():
    controller = table(3, 2)
    ready(controller, range(6))
    served_a = [controller.allocate("a", COLS, 4).rows, controller.allocate("a", COLS, 2).rows]
    assert served_a == [[0, 1, 2, 3], [4, 5]]
    assert controller.allocate("a", COLS, 1) is None
    assert controller.allocate("b", COLS, 6).rows == [0, 1, 2, 3, 4, 5]
    assert controller.consumed_count("a") == 6 and controller.consumed_count("b") == 6
    assert controller.consumed_count("never") == 0


def test_whole_groups_never_serves_an_incomplete_group():
    controller = table(3, 4)
    ready(controller, [0, 1, 2, 4, 5, 6, 7, 8, 9, 10])  # group 0 misses row 3, group 2 misses row 11
    allocation = controller.allocate("c", COLS, 8, whole_groups=True, min_count=4)
    assert allocation.rows == [4, 5, 6, 7]
    assert controller.allocate("c", COLS, 4, whole_groups=True) is None
    # Row mode for another consumer happily serves the same partial groups.
    assert controller.allocate("d", COLS, 10).rows == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    ready(controller, [3])
    assert controller.allocate("c", COLS, 4, whole_groups=True).rows == [0, 1, 2, 3]
    ready(controller, [11])
    assert controller.allocate("c", COLS, 4, whole_groups=True).rows == [8, 9, 10, 11]
    assert controller.all_consumed("c")


def test_whole_groups_count_must_be_a_multiple_of_equal_group_size():
    controller = table(2, 4)
    with pytest.raises(ValueError, match="multiples of the group size 4"):
        controller.allocate("c", COLS, 6, whole_groups=True)
    with pytest.raises(ValueError, match="multiples"):
        controller.allocate("c", COLS, 8, whole_groups=True, min_count=2)
    with pytest.raises(ValueError, match="never serve a group of 4"):
        controller.allocate("c", COLS, 2, whole_groups=True)
    with pytest.raises(ValueError, match="min_count <= count"):
        controller.allocate("c", COLS, 4, min_count=5)


def test_whole_groups_of_unequal_sizes_pack_first_fit_and_finish():
    controller = DockController(1)
    controller.add_groups([3, 2, 3, 1], [1, 1, 1, 1])  # rows 0-2 | 3-4 | 5-7 | 8
    ready(controller, range(9))
    served = []
    while (allocation := controller.allocate("c", COLS, 4, whole_groups=True)) is not None:
        served.append(allocation.rows)
    # Batch 1: group 0 (3 rows), group 1 does not fit, group 3 does -> full. Then the rest.
    assert served == [[0, 1, 2, 8], [3, 4], [5, 6, 7]]
    assert controller.all_consumed("c")


def test_tail_is_served_once_all_remaining_rows_are_ready():
    controller = table(5, 2)  # 10 rows, batches of 4
    ready(controller, range(9))
    assert controller.allocate("c", COLS, 4).rows == [0, 1, 2, 3]
    assert controller.allocate("c", COLS, 4).rows == [4, 5, 6, 7]
    # 2 rows remain (< 4) but row 9 is not ready: the tail waits for it.
    assert controller.allocate("c", COLS, 4) is None
    ready(controller, [9])
    assert controller.allocate("c", COLS, 4).rows == [8, 9]
    assert controller.all_consumed("c")
    assert controller.allocate("c", COLS, 4) is None


def test_tail_in_whole_groups_mode():
    controller = table(3, 2)
    ready(controller, range(6))
    assert controller.allocate("c", COLS, 4, whole_groups=True).rows == [0, 1, 2, 3]
    assert controller.allocate("c", COLS, 4, whole_groups=True).rows == [4, 5]


def test_min_count_defaults_to_count():
    controller = table(4, 2)
    ready(controller, range(5))
    assert controller.allocate("c", COLS, 6) is None
    assert controller.allocate("c", COLS, 6, min_count=5).rows == [0, 1, 2, 3, 4]


def test_all_consumed_is_false_on_an_empty_table():
    controller = DockController(1)
    assert not controller.all_consumed("c")
    assert controller.poll("c", COLS, 1) == (None, False)
    controller.add_groups([2], [1])
    ready(controller, [0, 1])
    assert not controller.all_consumed("c")
    allocation, done = controller.poll("c", COLS, 2)
    assert allocation.rows == [0, 1] and not done
    assert controller.poll("c", COLS, 2) == (None, True)
    assert controller.all_consumed("c") and not controller.all_consumed("other")


def test_reset_forgets_rows_columns_and_consumers():
    controller = table(2, 2)
    ready(controller, range(4))
    controller.allocate("c", COLS, 4)
    controller.reset()
    assert controller.num_rows() == 0
    stats = controller.stats()
    del stats["latency_ms"]
    assert stats == {
        "ages": {},
        "dropped": 0,
        "num_rows": 0,
        "num_groups": 0,
        "ready": {},
        "consumed": {},
        "warehouse_cells": [0, 0],
    }
    assert controller.add_groups([2], [1]) == [0, 1]
    assert controller.ready_counts(COLS) == {"response_ids": 0, "reward": 0}
    ready(controller, [0, 1])
    assert controller.allocate("c", COLS, 2).rows == [0, 1]


def test_locations_recorded_per_row_and_column():
    controller = table(2, 2, num_warehouses=3)
    controller.mark_ready(2, [0, 1, 2, 3], ["prompt_ids"])
    controller.mark_ready(1, [2, 3], ["response_ids"])
    controller.mark_ready(0, [0, 1], ["response_ids"])
    allocation = controller.allocate("c", ["prompt_ids", "response_ids"], 4)
    assert allocation.rows == [0, 1, 2, 3]
    assert allocation.locations == {"prompt_ids": [2, 2, 2, 2], "response_ids": [0, 0, 1, 1]}
    assert controller.locations([3], ["response_ids", "reward"]) == {"response_ids": [1], "reward": [-1]}
    assert controller.stats()["warehouse_cells"] == [2, 2, 4]
    controller.mark_ready(0, [3], ["response_ids"])  # re-put moves the cell
    assert controller.locations([3], ["response_ids"]) == {"response_ids": [0]}


def test_lengths_from_mark_ready():
    controller = table(1, 3)
    controller.mark_ready(0, [2, 0], ["response_ids"], {"response_len": [7, 4]})
    assert controller.lengths([0, 1, 2]) == {"prompt_len": [3, 3, 3], "response_len": [4, -1, 7]}
    with pytest.raises(ValueError, match="2 values for 1 rows"):
        controller.mark_ready(0, [1], ["response_ids"], {"response_len": [1, 2]})


def test_mark_ready_rejects_unknown_rows_and_warehouses():
    controller = table(1, 2)
    with pytest.raises(ValueError, match=r"rows \[2\] do not exist"):
        controller.mark_ready(0, [1, 2], ["x"])
    with pytest.raises(ValueError, match="warehouse=2"):
        controller.mark_ready(2, [0], ["x"])


def test_stats_counts():
    controller = table(3, 2)
    ready(controller, range(4), ["response_ids"], warehouse=1)
    controller.mark_ready(0, [0], ["reward"])
    controller.allocate("c", ["response_ids"], 3)
    stats = controller.stats()
    assert stats["num_rows"] == 6 and stats["num_groups"] == 3
    assert stats["ready"] == {"response_ids": 4, "reward": 1}
    assert stats["consumed"] == {"c": 3}
    assert stats["warehouse_cells"] == [1, 4]


def test_table_grows_past_initial_capacity_keeping_state():
    controller = DockController(1)
    controller.add_groups([8] * 4, [1] * 4)
    ready(controller, range(32))
    controller.allocate("c", COLS, 8)
    controller.add_groups([8] * 20, [2] * 20)  # past the initial capacity of 64 rows
    ready(controller, range(32, 192))
    assert controller.consumed_count("c") == 8
    assert controller.allocate("c", COLS, 200, min_count=1).rows == list(range(8, 192))
    assert controller.lengths([0, 191], ["prompt_len"]) == {"prompt_len": [1, 2]}


@settings(max_examples=40, deadline=None)
@given(
    group_size=st.integers(1, 4),
    num_groups=st.integers(1, 8),
    batch_groups=st.integers(1, 3),
    seed=st.randoms(use_true_random=False),
)
def test_interleaved_ready_and_allocate_serve_every_row_exactly_once(
    group_size, num_groups, batch_groups, seed
):
    controller = table(num_groups, group_size)
    pending = list(range(num_groups * group_size))
    seed.shuffle(pending)
    served: dict[str, list[int]] = {"groups": [], "rows": []}
    for _ in range(3 * len(pending) + 3):  # every round readies a row or, once all are ready, serves both
        if controller.all_consumed("groups") and controller.all_consumed("rows"):
            break
        if pending:
            ready(controller, [pending.pop()])
        for consumer, whole in (("groups", True), ("rows", False)):
            allocation = controller.allocate(consumer, COLS, batch_groups * group_size, whole_groups=whole)
            if allocation is None:
                continue
            served[consumer].extend(allocation.rows)
            if whole:
                groups = [row // group_size for row in allocation.rows]
                assert all(groups.count(group) == group_size for group in groups)
    else:
        pytest.fail(f"not all consumed: {controller.stats()}")
    for consumer in served:
        assert sorted(served[consumer]) == list(range(num_groups * group_size))


def test_warehouse_put_get_notifies_and_counts_bytes():
    controller = table(2, 2)
    warehouse = Warehouse(1, controller)
    responses = [torch.arange(n, dtype=torch.int64) for n in (3, 5)]
    nbytes = warehouse.put([2, 3], {"response_ids": responses, "reward": [0.5, 1.0]})
    assert nbytes == 8 * 8 + 2 * 24  # int64 tensors + two python floats
    assert controller.locations([2, 3], ["response_ids", "reward"]) == {
        "response_ids": [1, 1],
        "reward": [1, 1],
    }
    assert controller.lengths([2, 3], ["response_len"]) == {"response_len": [3, 5]}
    out = warehouse.get([3, 2], ["reward", "response_ids"])
    assert out["reward"] == [1.0, 0.5]
    assert torch.equal(out["response_ids"][0], responses[1])
    assert warehouse.get_cells({"reward": [2], "response_ids": [3]})["reward"] == [0.5]
    warehouse.put([2], {"reward": [0.25]})  # overwrite keeps the byte count exact
    stats = warehouse.stats()
    assert set(stats.pop("latency_ms")) == {"put", "get"}
    assert stats == {
        "index": 1,
        "rows": 2,
        "cells": 4,
        "bytes": 8 * 8 + 2 * 24,
        "num_puts": 2,
        "num_gets": 2,
        "cells_out": 6,
        "bytes_in": 8 * 8 + 3 * 24,
        "bytes_out": (2 * 24 + 8 * 8) + (24 + 5 * 8),
    }
    with pytest.raises(DockError, match=r"warehouse 1 holds no 'label' for rows \[2\]"):
        warehouse.get([2], ["label"])
    with pytest.raises(ValueError, match="has 1 values for 2 rows"):
        warehouse.put([0, 1], {"reward": [1.0]})
    warehouse.clear()
    assert warehouse.stats()["bytes"] == 0 and warehouse.stats()["cells"] == 0


def test_dropped_groups_are_never_served_and_do_not_count_as_unconsumed():
    controller = table(3, 2)
    ready(controller, range(6))
    first = controller.allocate("reward", COLS, 2, whole_groups=True)
    assert first.rows == [0, 1]
    assert controller.drop([2, 3]) == 2  # group 1 carries no signal
    # Neither the consumer that already read some rows nor a consumer that never asked gets group 1.
    assert controller.allocate("reward", COLS, 4, whole_groups=True, min_count=2).rows == [4, 5]
    assert controller.allocate("update", COLS, 6, min_count=1).rows == [0, 1, 4, 5]
    assert controller.all_consumed("reward") and controller.all_consumed("update")
    assert controller.stats()["dropped"] == 2
    controller.reset()
    controller.add_groups([2], [3])
    assert controller.stats()["dropped"] == 0


def test_peek_reads_ready_rows_again_and_again_without_consuming_them():
    """A checkpoint reads a step still in flight at every save until it trains (rollout.max_staleness >= 2
    with run.save_every < it): each read must see every ready row. Two `poll`s of one consumer would not
    (the second gets (None, True)); `peek` marks nothing."""
    controller = table(2, 2)
    ready(controller, range(4))
    assert controller.poll("checkpoint", COLS, 4)[0].rows == [0, 1, 2, 3]
    assert controller.poll("checkpoint", COLS, 4) == (None, True)  # what a second consuming read gets
    first, second = controller.peek(COLS), controller.peek(COLS)
    assert first.rows == second.rows == [0, 1, 2, 3]
    assert first.locations == {c: [0, 0, 0, 0] for c in COLS}
    assert controller.consumed_count("update") == 0 and controller.allocate("update", COLS, 4).rows == [
        0,
        1,
        2,
        3,
    ]
    controller.add_groups([2], [9])
    ready(controller, [4], ["response_ids"])
    controller.drop([2, 3])
    assert controller.peek(COLS).rows == [0, 1]  # rows 4-5 lack reward; dropped rows left the step
    assert controller.peek(["response_ids"]).rows == [0, 1, 4]
    assert controller.peek(["values"]).rows == []  # a column never put


def test_central_client_peeks_through_the_driver_hub_without_consuming():
    """dock.mode=driver/single: CentralClient.peek returns the ready rows' values, again and again."""
    from dockrl.dock.central import CentralClient, CentralDock, HubTransport
    from dockrl.dock.transport import ServiceHub

    hub = ServiceHub(CentralDock())
    client = CentralClient(HubTransport(hub.address, hub.authkey), "driver", get_timeout_s=30)
    client.add_groups([torch.tensor([5, 6]), torch.tensor([7])], ["a", "b"], 2)
    client.put("reward", [0, 1, 3], {"reward": [1.0, 2.0, 3.0]})
    for _ in range(2):
        rows, values = client.peek(["prompt_ids", "reward"])
        assert rows == [0, 1, 3] and values["reward"] == [1.0, 2.0, 3.0]
        assert [v.tolist() for v in values["prompt_ids"]] == [[5, 6], [5, 6], [7]]
    assert client.peek(["values"]) == ([], {"values": []})
    assert client.get("critic_update", ["reward"], 3, timeout_s=5)[0] == [0, 1, 3]  # nothing was consumed


def test_shared_controller_serves_a_parked_get_when_its_columns_arrive_and_ends_it_on_drop():
    import threading

    from dockrl.dock.shared import SharedController

    controller = SharedController(1)
    controller.add_groups([2, 2], [3, 3])
    results = {}

    def wait(name, rows_needed):
        results[name] = controller.wait_poll(name, COLS, rows_needed, 10.0)

    served = threading.Thread(target=wait, args=("a", 2))
    ended = threading.Thread(target=wait, args=("b", 4))
    served.start(), ended.start()
    ready(controller, [0, 1], ["response_ids"])
    ready(controller, [0, 1], ["reward"])  # rows 0-1 now have both columns: "a" is served
    served.join(5)
    assert results["a"][0].rows == [0, 1]
    ready(controller, [0, 1, 2, 3], COLS)  # "b" can take all four rows
    ended.join(5)
    assert results["b"][0].rows == [0, 1, 2, 3]
    timed_out = controller.wait_poll("a", COLS, 4, 0.05)  # only 2 unconsumed rows left for "a", min 4
    assert timed_out == (None, False) or timed_out[0].rows == [2, 3]  # tail rule: the remainder is served
    controller.drop([2, 3])
    assert controller.wait_poll("c", COLS, 2, 0.05)[0].rows == [0, 1]
    assert controller.wait_poll("c", COLS, 2, 0.05) == (None, True)  # dropped rows: nothing left, done
