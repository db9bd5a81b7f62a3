"""The dock on a local Ray runtime with 2 warehouses: concurrency, payload, placement, timeouts, failures."""

import os
import pickle
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dockrl.dock import (
    DockClient,
    DockError,
    DockTimeoutError,
    StaleHandleError,
    Warehouse,
    WarehouseDiedError,
    launch_dock,
)
from dockrl.dock.metrics import driver_bytes

GROUP_SIZE = 4
NUM_GROUPS = 8
NUM_ROWS = GROUP_SIZE * NUM_GROUPS


@pytest.fixture(scope="module")
def dock(ray_session):
    # Ray workers cannot import this test module: ship its functions and classes by value.
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    dock = launch_dock(num_warehouses=2, name_prefix="test-dock", get_timeout_s=20.0)
    yield dock
    dock.shutdown()


@pytest.fixture
def client(dock):
    client = dock.client()
    client.reset()
    return client


def prompt_of(group: int) -> torch.Tensor:
    return torch.arange(2 + group % 3) + 100 * group


def response_of(row: int) -> torch.Tensor:
    return torch.full((1 + row % 3,), 1000 + row)


def add_prompts(client, num_groups: int = NUM_GROUPS) -> list[int]:
    prompts = [prompt_of(group) for group in range(num_groups)]
    return client.add_groups(prompts, [f"label-{group}" for group in range(num_groups)], GROUP_SIZE)


def produce(client, seed: int) -> list[int]:
    """Rollout stand-in: take 2 prompts' groups at a time, write each row's response in random order."""
    rng = random.Random(seed)
    written = []
    while (
        got := client.get("rollout", ["prompt_ids"], 2 * GROUP_SIZE, whole_groups=True, min_count=GROUP_SIZE)
    ) is not None:
        rows, _ = got
        rng.shuffle(rows)
        for row in rows:
            time.sleep(rng.uniform(0.0, 0.01))
            client.put("rollout", [row], {"response_ids": [response_of(row)]})
            written.append(row)
    return written


def score(client) -> list[tuple[list[int], list[list[int]], list[list[int]], list[str]]]:
    """Reward stand-in: whole groups only; writes a reward per row, returns what it saw."""
    seen = []
    columns = ["prompt_ids", "response_ids", "label"]
    while (got := client.get("reward", columns, GROUP_SIZE, whole_groups=True)) is not None:
        rows, batch = got
        client.put("reward", rows, {"reward": [float(row) for row in rows]})
        seen.append(
            (
                rows,
                [t.tolist() for t in batch["prompt_ids"]],
                [t.tolist() for t in batch["response_ids"]],
                batch["label"],
            )
        )
    return seen


class Trainer:
    """Another consumer, as a Ray actor holding a pickled client."""

    def __init__(self, client):
        self.client = client

    def run(self) -> list[tuple[list[int], list[float], list[list[int]]]]:
        seen = []
        while (got := self.client.get("critic_update", ["response_ids", "reward"], 6)) is not None:
            rows, batch = got
            seen.append((rows, batch["reward"], [t.tolist() for t in batch["response_ids"]]))
        return seen


def test_concurrent_producers_and_consumers_serve_every_row_exactly_once(ray_session, dock, client):
    ray = ray_session
    trainer = ray.remote(num_cpus=0)(Trainer).remote(dock.client())
    # Consumers start first and wait on an empty table. Producers and reward consumers are driver threads
    # (each Ray process costs seconds of torch import on a small machine); the trainer is a Ray actor.
    with ThreadPoolExecutor(5) as pool:
        scores = [pool.submit(score, dock.client()) for _ in range(3)]
        trained = trainer.run.remote()
        produced = [pool.submit(produce, dock.client(home=home), seed=home) for home in (0, 1)]
        rows = add_prompts(client)
        assert rows == list(range(NUM_ROWS))
        written = [future.result(timeout=60) for future in produced]
        scored = [batch for future in scores for batch in future.result(timeout=60)]
    trained = ray.get(trained, timeout=60)
    ray.kill(trainer)
    assert sorted(written[0] + written[1]) == rows

    assert sorted(row for batch in scored for row in batch[0]) == rows  # exactly once, nothing lost
    for batch_rows, prompts, responses, labels in scored:
        group = batch_rows[0] // GROUP_SIZE
        assert batch_rows == list(range(group * GROUP_SIZE, (group + 1) * GROUP_SIZE))  # one whole group
        assert prompts == [prompt_of(group).tolist()] * GROUP_SIZE
        assert responses == [response_of(row).tolist() for row in batch_rows]
        assert labels == [f"label-{group}"] * GROUP_SIZE

    assert sorted(row for batch in trained for row in batch[0]) == rows
    assert [len(batch[0]) for batch in trained] == [6, 6, 6, 6, 6, 2]  # the 2-row tail is served too
    for batch_rows, rewards, responses in trained:
        assert rewards == [float(row) for row in batch_rows]
        assert responses == [response_of(row).tolist() for row in batch_rows]

    stats = client.stats()
    assert stats["consumed"] == {"rollout": NUM_ROWS, "reward": NUM_ROWS, "critic_update": NUM_ROWS}
    # Responses live where their producer put them (which producer took which groups is up to timing).
    locations = ray.get(dock.controller.locations.remote(rows, ["response_ids"]), timeout=10)["response_ids"]
    assert sorted(locations[row] for row in written[0]) == [0] * len(written[0])
    assert sorted(locations[row] for row in written[1]) == [1] * len(written[1])
    assert sum(w["cells"] for w in stats["warehouses"]) == sum(stats["warehouse_cells"]) == 4 * NUM_ROWS


def test_add_groups_spreads_groups_round_robin_and_replicates_prompt_and_label(ray_session, dock, client):
    rows = add_prompts(client, num_groups=3)
    locations = ray_session.get(dock.controller.locations.remote(rows, ["prompt_ids", "label"]), timeout=10)
    assert locations["prompt_ids"] == [0] * 4 + [1] * 4 + [0] * 4
    assert locations["label"] == locations["prompt_ids"]
    assert ray_session.get(dock.controller.lengths.remote(rows, ["prompt_len"]), timeout=10) == {
        "prompt_len": [2] * 4 + [3] * 4 + [4] * 4
    }
    rows_next = client.add_groups([prompt_of(3)], ["label-3"], GROUP_SIZE)
    assert ray_session.get(dock.controller.locations.remote(rows_next, ["prompt_ids"]), timeout=10) == {
        "prompt_ids": [1] * 4  # the cursor continues across calls
    }
    got_rows, batch = client.get("reward", ["prompt_ids", "label"], 16)
    assert got_rows == list(range(16))
    assert [t.tolist() for t in batch["prompt_ids"][3:5]] == [prompt_of(0).tolist(), prompt_of(1).tolist()]
    assert batch["label"][::4] == ["label-0", "label-1", "label-2", "label-3"]
    assert client.all_consumed("reward") and client.get("reward", ["label"], 4) is None


def test_rows_put_by_a_client_are_recorded_at_its_home_warehouse(ray_session, dock, client):
    rows = add_prompts(client, num_groups=1)
    assert client.home in (0, 1)  # default: a warehouse on the driver's node (both are here)
    node = ray_session.get_runtime_context().get_node_id()
    remote_first = DockClient(dock.controller, dock.warehouses, warehouse_nodes=["some-other-node", node])
    assert remote_first.home == 1  # the only warehouse on this node
    remote_first.put("rollout", rows[:2], {"response_ids": [response_of(0), response_of(1)]})
    assert DockClient(dock.controller, dock.warehouses, warehouse_nodes=["a", "b"]).home == 0  # none here
    dock.client(home=0).put("rollout", rows[2:], {"response_ids": [response_of(2), response_of(3)]})
    locations = ray_session.get(dock.controller.locations.remote(rows, ["response_ids"]), timeout=10)
    assert locations == {"response_ids": [1, 1, 0, 0]}
    held = [w["cells"] for w in client.stats()["warehouses"]]
    assert held == [2 * 4 + 2, 2]  # warehouse 0 also holds the group's prompt_ids and label


def test_client_pickles_and_re_resolves_its_home(ray_session, dock):
    client = dock.client(home=None)
    assert client.home == os.getpid() % 2  # both warehouses are on this node: spread by process id
    client._home = 5
    clone = pickle.loads(pickle.dumps(client))
    assert clone._home is None and clone.home == os.getpid() % 2  # re-resolved where it was unpickled
    assert pickle.loads(pickle.dumps(dock.client(home=1)))._home == 1


def test_get_that_cannot_be_served_times_out_naming_consumer_and_ready_counts(client):
    add_prompts(client, num_groups=1)
    start = time.monotonic()
    with pytest.raises(DockTimeoutError) as error:
        client.get("critic_update", ["prompt_ids", "values"], 4, timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    message = str(error.value)
    assert "'critic_update'" in message and "asked for 4 rows" in message
    assert "{'prompt_ids': 4, 'values': 0}" in message
    assert "consumed by 'critic_update': 0 of 4 rows" in message


def test_killed_warehouse_turns_get_into_dock_error_naming_it(ray_session, dock, client):
    # A fresh warehouse 1 next to the module's controller and warehouse 0 (one process instead of a dock).
    doomed = ray_session.remote(Warehouse).options(num_cpus=0, name="test-dock-doomed").remote(1)
    fragile = DockClient(dock.controller, [dock.warehouses[0], doomed], warehouse_nodes=dock.warehouse_nodes)
    # Group 0 on warehouse 0, group 1 (rows 4-7) on the doomed one; list prompts spare it a torch import.
    fragile.add_groups([[1, 2], [3]], ["a", "b"], GROUP_SIZE)
    ray_session.kill(doomed)
    start = time.monotonic()
    with pytest.raises(WarehouseDiedError, match=r"dock warehouse 1 on node \w+ died .*\[4, 5, 6, 7\]"):
        fragile.get("rollout", ["prompt_ids"], 8)
    assert time.monotonic() - start < 10.0
    with pytest.raises(DockError, match="dock warehouse 1"):
        DockClient(dock.controller, [dock.warehouses[0], doomed], home=1).put(
            "reward", [0], {"reward": [1.0]}
        )


def test_warehouse_killed_mid_step_fails_a_waiting_consumer_naming_it_and_its_rows(ray_session, dock):
    doomed = ray_session.remote(Warehouse).options(num_cpus=0, name="test-dock-doomed-2").remote(1)
    fragile = DockClient(
        dock.controller, [dock.warehouses[0], doomed], warehouse_nodes=dock.warehouse_nodes, home=0
    )
    fragile.reset()
    fragile.add_groups([[1, 2], [3]], ["a", "b"], GROUP_SIZE)  # group 1 (rows 4-7) lives on the doomed one
    fragile.put("rollout", [0, 1, 2, 3], {"response_ids": [[1]] * 4})
    killer = ThreadPoolExecutor(1)
    killer.submit(lambda: (time.sleep(0.5), ray_session.kill(doomed)))
    start = time.monotonic()
    # The consumer waits for responses that the (dead) rollout of rows 4-7 will never write.
    with pytest.raises(WarehouseDiedError, match=r"dock warehouse 1 .* rows affected: \[4, 5, 6, 7\]"):
        fragile.get("reward", ["prompt_ids", "response_ids"], 8, timeout_s=30)
    assert time.monotonic() - start < 15  # a health check, not the 30 s timeout
    killer.shutdown()


def test_killed_warehouse_of_a_socket_dock_is_named_with_its_rows(ray_session):
    # The default transport: clients hold direct connections to the warehouses' hubs.
    dock = launch_dock(num_warehouses=2, name_prefix="test-socket-kill", get_timeout_s=20.0)
    try:
        client = dock.client(home=0)
        client.add_groups([[1, 2], [3]], ["a", "b"], GROUP_SIZE)  # group 1 (rows 4-7) on warehouse 1
        client.put("rollout", [0, 1, 2, 3], {"response_ids": [[1]] * 4})
        ray_session.kill(dock.warehouses[1])
        start = time.monotonic()
        with pytest.raises(WarehouseDiedError, match=r"dock warehouse 1 .* rows affected: \[4, 5, 6, 7\]"):
            client.get("reward", ["prompt_ids", "response_ids"], 8)
        assert time.monotonic() - start < 10.0
    finally:
        dock.shutdown()


def test_relaunched_dock_makes_old_handles_stale(ray_session):
    old = launch_dock(num_warehouses=1, name_prefix="test-stale", get_timeout_s=10.0)
    client = old.client()
    client.reset()
    old.shutdown()
    time.sleep(0.5)  # let Ray release the names
    new = launch_dock(num_warehouses=1, name_prefix="test-stale", get_timeout_s=10.0)
    try:
        with pytest.raises(StaleHandleError, match="dock controller was restarted .* new client"):
            client.reset()
        new.client().reset()  # a fresh client works
    finally:
        new.shutdown()


@pytest.mark.parametrize("mode, transport", [("single", "socket"), ("single", "ray"), ("driver", "socket")])
def test_comparison_modes_serve_the_same_interface(ray_session, mode, transport):
    # single mode takes either transport, as dock mode does; driver mode's hub is always a socket
    central = launch_dock(
        mode=mode, name_prefix=f"test-{mode}-{transport}", get_timeout_s=10.0, transport=transport
    )
    try:
        client = central.client()
        rows = add_prompts(client, num_groups=2)
        worker = pickle.loads(pickle.dumps(central.client()))  # as a worker would get it
        got_rows, batch = worker.get("rollout", ["prompt_ids"], GROUP_SIZE, whole_groups=True)
        assert got_rows == rows[:GROUP_SIZE] and batch["prompt_ids"][0].tolist() == prompt_of(0).tolist()
        worker.put("rollout", got_rows, {"response_ids": [response_of(r) for r in got_rows]})
        with pytest.raises(DockTimeoutError, match=r"rows not ready: \[4, 5, 6, 7\]"):
            worker.get("reward", ["response_ids"], 8, timeout_s=0.3)
        got_rows, batch = worker.get("reward", ["response_ids", "label"], 8, min_count=1)
        assert got_rows == rows[:GROUP_SIZE] and batch["label"] == ["label-0"] * GROUP_SIZE
        stats = client.stats()
        assert stats["mode"] == mode and stats["consumed"] == {"rollout": 4, "reward": 4}
        assert stats["ready"]["response_ids"] == GROUP_SIZE
        prompt_bytes = prompt_of(0).nbytes + prompt_of(1).nbytes
        assert client.stats()["client"]["bytes_put"] == prompt_bytes + 2 * sys.getsizeof("label-0")
        responses = sum(response_of(r).nbytes for r in got_rows)
        expected_driver = stats["client"]["bytes_put"] if mode == "single" else None
        if mode == "driver":  # every byte passes the driver: puts (prompts x rows, responses) and gets
            assert (
                driver_bytes(stats)
                == stats["warehouses"][0]["bytes_in"] + stats["warehouses"][0]["bytes_out"]
            )
            assert driver_bytes(stats) > 2 * responses
        else:
            assert driver_bytes(stats) == expected_driver
        assert client.reset() == [] and client.stats()["num_rows"] == 0
    finally:
        central.shutdown()


def test_dock_stats_report_traffic_latency_and_driver_bytes(dock, client):
    rows = add_prompts(client, num_groups=2)
    worker = dock.client(home=1)
    worker.put("rollout", rows, {"response_ids": [response_of(r) for r in rows]})
    rows_got, batch = worker.get("update", ["response_ids"], 8, balance_over=2)
    assert len(rows_got) == 4
    stats = client.stats()
    assert stats["ready"]["response_ids"] == 8 and stats["consumed"] == {"update": 8}
    group_1 = GROUP_SIZE * (prompt_of(1).nbytes + sys.getsizeof("label-1"))  # round-robin: group 1 is here
    assert stats["warehouses"][1]["bytes_in"] == group_1 + sum(response_of(r).nbytes for r in rows)
    assert stats["warehouses"][1]["bytes_out"] == sum(t.nbytes for t in batch["response_ids"])
    assert {"add_groups", "mark_ready", "allocate"} <= set(stats["latency_ms"])
    assert driver_bytes(stats) == prompt_of(0).nbytes + prompt_of(1).nbytes + 2 * sys.getsizeof("label-0")


def test_warehouses_store_tensors_without_importing_torch(ray_session):
    """Tensors travel sealed (dock/cells.py): a warehouse stores their bytes and never imports torch. Four
    warehouses importing torch beside a step cut the dock's rows/s by two thirds on 4 emulated nodes once
    (issue 46): this fails if a warehouse decodes a cell or preloads torch again."""
    import ray

    dock = launch_dock(num_warehouses=2, name_prefix="test-sealed", get_timeout_s=20.0)
    try:
        client = dock.client()
        rows = add_prompts(client, num_groups=2)
        logprobs = [torch.randn(1 + row % 3).to(torch.bfloat16) for row in rows]
        dock.client(home=1).put(
            "rollout",
            rows,
            {"response_ids": [response_of(r) for r in rows], "rollout_logprobs": logprobs},
        )
        got_rows, batch = client.get("update", ["response_ids", "rollout_logprobs"], 8)
        assert got_rows == rows
        assert all(torch.equal(a, response_of(r)) for a, r in zip(batch["response_ids"], rows))
        assert all(
            torch.equal(a, b) and a.dtype == torch.bfloat16
            for a, b in zip(batch["rollout_logprobs"], logprobs)
        )

        def torch_imported(warehouse) -> bool:
            return "torch" in sys.modules

        imported = ray.get([w.__ray_call__.remote(torch_imported) for w in dock.warehouses], timeout=20)
        assert imported == [False, False]
    finally:
        dock.shutdown()
