"""The dock on an emulated 3-node cluster (dockrl.bench.netem): one warehouse on each node, rows homed where
they were produced, and under `dock.policy: local` every consumer reads its rows from its own node.

The same requests run under `first`, which ignores where rows live, and must NOT come out local: the check
would see locality lost (issue 46: the dock once lost its multi-node gain without a test noticing). Needs root
and iproute2; skipped otherwise.
"""

import json
import sys
import textwrap

import pytest

from dockrl.bench import netem

_reason = netem.unavailable()
if _reason:
    pytest.skip(f"EmulatedCluster unavailable: {_reason}", allow_module_level=True)

pytestmark = pytest.mark.distributed

NODES, GROUPS_PER_NODE, GROUP_SIZE, RESPONSE_TOKENS = 3, 2, 2, 256
ROWS_PER_NODE = GROUPS_PER_NODE * GROUP_SIZE

# Runs in the head's namespace. Producer i (on node i) writes the responses of its groups; then a reward
# consumer (whole groups) and an update consumer (balanced over the nodes) on each node read, one after another.
SCENARIO = textwrap.dedent(
    """
    import json, sys
    import ray, torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from dockrl.dock import launch_dock

    nodes_n, groups_per_node, group_size, tokens = (int(a) for a in sys.argv[2:6])
    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR", configure_logging=False)

    @ray.remote(num_cpus=0)
    def produce(client, rows):
        client.put("rollout", rows, {"response_ids": [torch.full((tokens,), r) for r in rows]})
        return ray.util.get_node_ip_address()

    @ray.remote(num_cpus=0)
    def consume(client, stage, count, options):
        rows, batch = client.get(stage, ["prompt_ids", "response_ids"], count, **options)
        assert all(int(t[0]) == r for r, t in zip(rows, batch["response_ids"]))
        return rows, client.client_stats()["bytes_got_near"], client.client_stats()["bytes_got"]

    def where(warehouse):
        return ray.util.get_node_ip_address()

    driver = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: n != driver)
    on = [NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes]
    out = {}
    for policy in ("local", "first"):
        dock = launch_dock(name_prefix=f"emulated-{policy}", get_timeout_s=60.0, policy=policy)
        try:
            client = dock.client()
            prompts = [torch.arange(4) + g for g in range(nodes_n * groups_per_node)]
            rows = client.add_groups(prompts, ["x"] * len(prompts), group_size)
            share = groups_per_node * group_size
            producers = [
                produce.options(scheduling_strategy=on[i]).remote(dock.client(), rows[i * share:(i + 1) * share])
                for i in range(nodes_n)
            ]
            produced_on = ray.get(producers, timeout=120)
            reward, update = [], []
            for i in (2, 0, 1):  # not in node order: rows must follow the caller's node, not its turn
                options = {"whole_groups": True}
                reward.append((i, ray.get(consume.options(scheduling_strategy=on[i]).remote(
                    dock.client(), "reward", share, options), timeout=120)))
            for i in (2, 0, 1):
                options = {"balance_over": nodes_n}
                update.append((i, ray.get(consume.options(scheduling_strategy=on[i]).remote(
                    dock.client(), "update", share, options), timeout=120)))
            out[policy] = {
                "warehouse_ips": ray.get([w.__ray_call__.remote(where) for w in dock.warehouses], timeout=60),
                "produced_on": produced_on,
                "locations": ray.get(dock.controller.locations.remote(rows, ["response_ids"]))["response_ids"],
                "reward": dict(reward),
                "update": dict(update),
            }
        finally:
            dock.shutdown()
    print(json.dumps(out))
    """
)


def test_each_node_holds_one_warehouse_and_local_consumers_read_their_own_node():
    with netem.EmulatedCluster(nodes=NODES, link_mbit=1000) as cluster:
        argv = [sys.executable, "-c", SCENARIO, cluster.head_address]
        argv += [str(x) for x in (NODES, GROUPS_PER_NODE, GROUP_SIZE, RESPONSE_TOKENS)]
        done = cluster.run_in(0, argv, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        node_ips = cluster.node_ips
    own_rows = [list(range(i * ROWS_PER_NODE, (i + 1) * ROWS_PER_NODE)) for i in range(NODES)]
    for policy, seen in result.items():
        # one warehouse per node (the driver's first), and every producer wrote to the one on its own node
        assert sorted(seen["warehouse_ips"]) == sorted(node_ips) and seen["warehouse_ips"][0] == node_ips[0]
        homes = [seen["warehouse_ips"].index(ip) for ip in seen["produced_on"]]
        assert seen["locations"] == [home for home in homes for _ in range(ROWS_PER_NODE)]
        reward_local = [seen["reward"][str(i)][0] == own_rows[i] for i in range(NODES)]
        update_local = [seen["update"][str(i)][0] == own_rows[i] for i in range(NODES)]
        if policy == "local":
            assert reward_local == update_local == [True] * NODES, seen
            # the responses are most of each get's bytes: all of them came from the consumer's own node
            for rows, near, got in [*seen["reward"].values(), *seen["update"].values()]:
                assert near >= len(rows) * RESPONSE_TOKENS * 8 and near <= got
        else:  # `first` serves lowest rows and mixes bins over nodes: the same check sees it
            assert reward_local != [True] * NODES and update_local != [True] * NODES, seen
