"""The dock on a 2-node Ray cluster (ray.cluster_utils.Cluster on this machine): one warehouse per node,
rows homed on their producer's node, consumers on both nodes served.

The cluster needs its own Ray runtime, so the scenario runs in a subprocess and leaves the session's Ray
alone; it prints one JSON line that the test checks.
"""

import json
import os
import subprocess
import sys
import textwrap

SCENARIO = textwrap.dedent(
    """
    import json, os
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from dockrl.dock import launch_dock

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        driver = ray.get_runtime_context().get_node_id()
        nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: n != driver)
        dock = launch_dock(name_prefix="cluster", get_timeout_s=30.0)  # default: one warehouse per node

        @ray.remote(num_cpus=0)
        def produce(client, rows):
            client.put("rollout", rows, {"response_ids": [[row] * 3 for row in rows]})
            return ray.get_runtime_context().get_node_id(), client.home

        @ray.remote(num_cpus=0)
        def consume(client, name):
            seen = []
            while (got := client.get(name, ["prompt_ids", "response_ids"], 2, whole_groups=True)) is not None:
                seen += [(row, r) for row, r in zip(got[0], got[1]["response_ids"])]
            return ray.get_runtime_context().get_node_id(), seen

        def on(node):
            return NodeAffinitySchedulingStrategy(node, soft=False)

        client = dock.client()
        rows = client.add_groups([[1, 2], [3, 4], [5, 6], [7, 8]], list("abcd"), 2)
        consumers = [
            consume.options(scheduling_strategy=on(n)).remote(dock.client(), ["reward", "reward_model"][i])
            for i, n in enumerate(nodes)
        ]
        produced = ray.get(
            [produce.options(scheduling_strategy=on(n)).remote(dock.client(), rows[4 * i : 4 * i + 4])
             for i, n in enumerate(nodes)],
            timeout=60,
        )
        consumed = ray.get(consumers, timeout=60)
        locations = ray.get(dock.controller.locations.remote(rows, ["response_ids"]), timeout=30)
        print(json.dumps({
            "nodes": nodes, "warehouse_nodes": dock.warehouse_nodes, "produced": produced,
            "consumed": consumed, "locations": locations["response_ids"],
        }))
    finally:
        ray.shutdown()
        cluster.shutdown()
    """
)


def test_two_node_cluster_homes_rows_on_the_producer_node_and_serves_both_nodes(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    nodes = result["nodes"]
    assert len(nodes) == 2 and result["warehouse_nodes"] == nodes  # one warehouse per node, driver's first
    for i, (node, home) in enumerate(result["produced"]):
        assert node == nodes[i] and result["warehouse_nodes"][home] == node  # producer writes on-node
        assert result["locations"][4 * i : 4 * i + 4] == [home] * 4  # rows homed on the producer's node
    # A consumer on each node reads every row exactly once, half of them from the other node's warehouse.
    assert [node for node, _ in result["consumed"]] == nodes
    for _, seen in result["consumed"]:
        assert sorted(row for row, _ in seen) == list(range(8))
        assert all(response == [row] * 3 for row, response in seen)
