"""`dockrl bench dock`: a synthetic GRPO-shaped step through the dock, in dock / single / driver mode.

```
 driver --add_groups(prompts x samples)--> dock
 consumer i (one Ray actor per data-parallel rank, on node i mod nodes), four threads each:
   rollout      : whole groups of prompt_ids -> response_ids [R] int32 + rollout_logprobs [R] float32
   reward       : whole groups of prompt_ids, response_ids, label -> reward, update_weight
   old_logprobs : rows/consumers balanced by tokens, prompt_ids + response_ids -> old_logprobs [R] float32
   update       : rows/consumers balanced, response_ids + old_logprobs + rollout_logprobs + update_weight
```
Each thread is the dock Stage of its name, reading and writing only what that stage does (dock/columns.py).

Response lengths R are long-tailed (lognormal, sigma 1, clipped at 4x the mean) with mean
tokens_per_row - prompt_tokens. For each node count (a local Ray runtime, or a 2-node
ray.cluster_utils.Cluster on this machine) and each mode x warehouse count, it runs warm-up + measured
steps and reports rows/s, MB/s (bytes put + got at the store), p50/p99 of the workers' put/get latency, and
the payload bytes that passed through the driver. Module-level imports stay light (the CLI imports this
module to build its parser).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from dockrl.dock.api import DockAPI
from dockrl.dock.columns import (
    LABEL,
    OLD_LOGPROBS,
    PROMPT_IDS,
    RESPONSE_IDS,
    REWARD,
    ROLLOUT_LOGPROBS,
    UPDATE_WEIGHT,
)
from dockrl.dock.stages import Stage

if TYPE_CHECKING:
    from dockrl.dock.central import CentralClient
    from dockrl.dock.client import DockClient

STAGES = (Stage.ROLLOUT, Stage.REWARD, Stage.OLD_LOGPROBS, Stage.UPDATE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench dock` (the defaults finish in a few minutes on 2 cores)."""
    parser.add_argument("--modes", default="dock,single,driver", help="comma list of dock, single, driver")
    parser.add_argument(
        "--warehouses",
        default=None,
        help="warehouse counts tried in dock mode (default 1,2,4; one per node on a multi-node cluster)",
    )
    parser.add_argument(
        "--nodes",
        default=None,
        help="node counts (default 1,2; 2 = a 2-node Cluster sharing this machine's loopback)",
    )
    parser.add_argument(
        "--emulate-nodes",
        default=None,
        help="comma list of node counts, each an emulated cluster: one network namespace per node behind a "
        "rate-limited link (--link-mbit, --delay-ms), the driver in the head's namespace (needs root, ip, tc)",
    )
    parser.add_argument(
        "--link-mbit",
        default="200",
        help="comma list of link speeds of the emulated nodes (each way), mbit/s",
    )
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="one-way delay added to each emulated link"
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="run on this existing Ray cluster (e.g. auto) with every alive node; consumers one per node",
    )
    parser.add_argument(
        "--consumers",
        type=int,
        default=4,
        help="consumer actors (data-parallel ranks); at least one per node",
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (group size)")
    parser.add_argument("--tokens-per-row", type=int, default=16384, help="mean prompt+response tokens")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per configuration")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on every step")
    parser.add_argument(
        "--policies",
        default="first,local",
        help="comma list of dock.policy values tried in dock mode (first: lowest row ids; local: rows held on "
        "the consumer's node first, bins cut by node); the central modes have one store and run first",
    )
    parser.add_argument(
        "--transport",
        default=None,
        help="comma list of socket, ray (dock.transport) for the dock and single modes (default socket,ray on one "
        "machine, socket on a multi-node cluster); driver mode has its own socket hub",
    )


class BenchConsumer:
    """One data-parallel rank: serves every stage in its own thread until the dock says the step is done."""

    def __init__(self, index: int, num_consumers: int, args: dict) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.index, self.num_consumers, self.args = index, num_consumers, args
        self.client: DockClient | CentralClient | None = None
        # One thread per stage for the actor's life, as a worker's threads live for the run: the socket
        # transport keeps one connection per thread, and a pool made per step would pay a new connection and
        # handshake to every dock actor on every step (measured: a fifth of a consumer's CPU).
        self._pool = ThreadPoolExecutor(len(STAGES), thread_name_prefix="bench-stage")

    def set_client(self, client: DockClient | CentralClient) -> None:
        """The client of the dock under test, given once per configuration as a worker gets it at start-up
        (unpickling a client resolves Ray actor handles, which is not per-step work)."""
        self.client = client

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def run_step(self, step: int) -> tuple[list[float], int, int]:
        """Serve the four stages of one step; returns the put/get latencies (s) this rank saw, and the bytes it
        got: in all, and from a warehouse on its own node (dock mode; 0 in the central modes)."""
        stats = self.client.client_stats() if self.client is not None else {}
        before = stats.get("bytes_got", 0), stats.get("bytes_got_near", 0)
        futures = [self._pool.submit(getattr(self, f"_{stage}"), self.client, step) for stage in STAGES]
        latencies = [x for f in futures for x in f.result()]
        stats = self.client.client_stats() if self.client is not None else {}
        got = stats.get("bytes_got", 0) - before[0]
        return latencies, got, stats.get("bytes_got_near", 0) - before[1]

    def _loop(
        self, client: DockAPI, stage: Stage, columns: list[str], count: int, work, **options
    ) -> list[float]:
        latencies = []
        while True:
            t0 = time.perf_counter()
            got = client.get(stage, columns, count, **options)
            latencies.append(time.perf_counter() - t0)
            if got is None:
                return latencies
            rows, batch = got
            out = work(rows, batch)
            if out:
                t0 = time.perf_counter()
                client.put(stage, rows, out)
                latencies.append(time.perf_counter() - t0)

    def _rollout(self, client: DockAPI, step: int) -> list[float]:
        import numpy as np

        mean = self.args["tokens_per_row"] - self.args["prompt_tokens"]

        def generate(rows, batch):
            lengths = [response_length(step, row, mean) for row in rows]
            return {
                RESPONSE_IDS: [np.full(n, row, dtype=np.int32) for row, n in zip(rows, lengths)],
                ROLLOUT_LOGPROBS: [np.full(n, -1.0, dtype=np.float32) for n in lengths],
            }

        g = self.args["samples"]
        return self._loop(
            client, Stage.ROLLOUT, [PROMPT_IDS], 2 * g, generate, whole_groups=True, min_count=g
        )

    def _reward(self, client: DockAPI, step: int) -> list[float]:
        def score(rows, batch):
            return {
                REWARD: [float(len(r) % 2) for r in batch[RESPONSE_IDS]],
                UPDATE_WEIGHT: [1.0] * len(rows),
            }

        g = self.args["samples"]
        columns = [PROMPT_IDS, RESPONSE_IDS, LABEL]
        return self._loop(client, Stage.REWARD, columns, g, score, whole_groups=True)

    def _per_rank(self) -> int:
        return -(-self.args["prompts"] * self.args["samples"] // self.num_consumers)

    def _old_logprobs(self, client: DockAPI, step: int) -> list[float]:
        def logprobs(rows, batch):
            return {OLD_LOGPROBS: [r.astype("float32") * 0 - 1 for r in batch[RESPONSE_IDS]]}

        columns = [PROMPT_IDS, RESPONSE_IDS]
        n = self._per_rank()
        return self._loop(client, Stage.OLD_LOGPROBS, columns, n, logprobs, balance_over=self.num_consumers)

    def _update(self, client: DockAPI, step: int) -> list[float]:
        columns = [RESPONSE_IDS, OLD_LOGPROBS, ROLLOUT_LOGPROBS, UPDATE_WEIGHT]
        n = self._per_rank()
        return self._loop(
            client, Stage.UPDATE, columns, n, lambda rows, batch: None, balance_over=self.num_consumers
        )


def response_length(step: int, row: int, mean: int) -> int:
    """Long-tailed response length of one row (deterministic in step and row)."""
    import numpy as np

    rng = np.random.default_rng([step, row])
    sigma = 1.0
    draw = rng.lognormal(mean=np.log(mean) - sigma**2 / 2, sigma=sigma)  # E[draw] = mean
    return int(np.clip(draw, 1, 4 * mean))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration; one dict per (nodes, mode, warehouses, transport)."""
    import ray

    if args.emulate_nodes is not None or args.ray_address is not None:
        if args.nodes is not None:
            given = "--emulate-nodes" if args.emulate_nodes is not None else "--ray-address"
            raise SystemExit(f"dockrl bench dock: --nodes={args.nodes} conflicts with {given}; drop --nodes")
        if args.emulate_nodes is not None:
            return _run_emulated(args)
        return _run_on_address(args)
    results = []
    for nodes in [int(n) for n in (args.nodes or "1,2").split(",")]:
        cluster = _start_ray(nodes)
        try:
            results += _run_on_cluster(args, nodes)
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    return results


def _run_on_address(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Join the cluster at --ray-address and run every configuration on all of its alive nodes."""
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=args.ray_address, log_to_driver=False, configure_logging=False)
    try:
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        args.consumers = max(args.consumers, nodes)  # every node hosts a producer and a consumer
        args.warehouses = args.warehouses or str(nodes)  # one per node: rows stay where they were produced
        args.transport = args.transport or "socket"
        return _run_on_cluster(args, nodes)
    finally:
        ray.shutdown()


def _run_emulated(args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each node count, build an emulated cluster and run this benchmark (--ray-address) in the head
    node's namespace, so the driver sits behind a rate-limited link like every other node."""
    import json

    from dockrl.bench.netem import EmulatedCluster, unavailable

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"dockrl bench dock --emulate-nodes: {reason}")
    names: tuple[str, ...] = ("modes", "warehouses", "consumers", "prompts", "samples", "tokens_per_row")
    names += ("prompt_tokens", "steps", "warmup", "timeout_s", "transport", "policies")
    passed = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names if getattr(args, n) is not None]
    results = []
    shapes = [(int(n), float(b)) for b in args.link_mbit.split(",") for n in args.emulate_nodes.split(",")]
    for nodes, link_mbit in shapes:
        with EmulatedCluster(nodes=nodes, link_mbit=link_mbit, delay_ms=args.delay_ms) as cluster:
            argv = [sys.executable, "-m", "dockrl.cli", "bench", "dock", "--json", *passed]
            done = cluster.run_in(
                0, [*argv, f"--ray-address={cluster.head_address}"], timeout=_budget_s(args)
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"bench dock on {nodes} emulated nodes failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
                )
            rows = json.loads(done.stdout.strip().splitlines()[-1])
        results += [{**row, "link_mbit": link_mbit, "delay_ms": args.delay_ms} for row in rows]
    return results


def _budget_s(args: argparse.Namespace) -> float:
    """A bound on one cluster's whole run: start-up, then every configuration's steps at --timeout-s each."""
    warehouse_counts = len((args.warehouses or "1").split(","))
    configs = len(args.modes.split(",")) * warehouse_counts * len((args.transport or "socket").split(","))
    configs *= len(args.policies.split(","))
    return 120.0 + configs * (args.warmup + args.steps) * args.timeout_s


def _start_ray(nodes: int):
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local benchmark cluster, as in init_ray

    settings: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if nodes == 1:
        ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", **settings)
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    return cluster


def _run_on_cluster(args: argparse.Namespace, nodes: int) -> list[dict[str, Any]]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dockrl.dock.launch import launch_dock

    driver_node = ray.get_runtime_context().get_node_id()
    node_ids = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: n != driver_node)
    settings = {k: getattr(args, k) for k in ("prompts", "samples", "tokens_per_row", "prompt_tokens")}
    consumer_class: Any = ray.remote(BenchConsumer)
    consumers = [
        consumer_class.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids[i % nodes], soft=False)
        ).remote(i, args.consumers, settings)
        for i in range(args.consumers)
    ]
    ray.get([c.node_id.remote() for c in consumers], timeout=args.timeout_s)
    configs = []
    transports = (args.transport or "socket,ray").split(",")
    for mode in args.modes.split(","):
        counts = [int(w) for w in (args.warehouses or "1,2,4").split(",")] if mode == "dock" else [1]
        policies = args.policies.split(",") if mode == "dock" else ["first"]
        for transport in ["socket"] if mode == "driver" else transports:  # the driver's hub is a socket
            configs += [(mode, w, transport, policy) for w in counts for policy in policies]
    results = []
    for mode, num_warehouses, transport, policy in configs:
        dock = launch_dock(
            mode=mode,
            num_warehouses=num_warehouses,
            name_prefix=f"bench-{mode}-{num_warehouses}-{transport}-{policy}",
            get_timeout_s=args.timeout_s,
            transport=transport,
            policy=policy,
        )
        try:
            row = _measure(args, dock, consumers, nodes, mode, num_warehouses, transport)
            results.append({**row, "policy": policy})
        finally:
            dock.shutdown()
    for consumer in consumers:
        ray.kill(consumer)
    return results


def _measure(
    args, dock, consumers, nodes: int, mode: str, num_warehouses: int, transport: str
) -> dict[str, Any]:
    import numpy as np
    import ray

    from dockrl.dock.metrics import busy_totals, bytes_moved, driver_bytes

    client = dock.client()
    client.reset()
    ray.get([c.set_client.remote(dock.client()) for c in consumers], timeout=args.timeout_s)
    rows_per_step = args.prompts * args.samples
    seconds, moved, through_driver, prompt_bytes, latencies = 0.0, 0, 0, 0, []
    consumer_got, consumer_got_near = 0, 0
    served = [0, 0.0]  # calls and seconds of the controller's (other modes: the store's) own service
    for step in range(args.warmup + args.steps):
        prompts = [np.arange(args.prompt_tokens, dtype=np.int32) + p for p in range(args.prompts)]
        start = time.perf_counter()
        client.add_groups(prompts, [f"answer-{p}" for p in range(args.prompts)], args.samples)
        refs = [c.run_step.remote(step) for c in consumers]
        try:
            per_rank = ray.get(refs, timeout=args.timeout_s)
        except ray.exceptions.GetTimeoutError:
            stats = client.stats()
            raise RuntimeError(
                f"bench step {step} ({mode}, {num_warehouses} warehouses, {nodes} nodes) did not finish in "
                f"--timeout-s={args.timeout_s:g}: ready {stats['ready']}, consumed {stats['consumed']}"
            ) from None
        elapsed = time.perf_counter() - start
        step_latencies = [x for latencies_of_rank, _, _ in per_rank for x in latencies_of_rank]
        before = busy_totals(stats.get("latency_ms", {})) if step else (0, 0.0)
        stats = client.stats()
        client.reset()
        if step >= args.warmup:
            seconds += elapsed
            moved += bytes_moved(stats)
            through_driver += driver_bytes(stats)
            prompt_bytes += sum(p.nbytes for p in prompts) + sum(
                sys.getsizeof(f"answer-{p}") for p in range(len(prompts))
            )
            latencies += step_latencies
            consumer_got += sum(got for _, got, _ in per_rank)
            consumer_got_near += sum(near for _, _, near in per_rank)
            after = busy_totals(stats.get("latency_ms", {}))
            served = [served[0] + after[0] - before[0], served[1] + after[1] - before[1]]
    ms = np.asarray(latencies) * 1e3
    return {
        "mode": mode,
        "transport": transport,
        "nodes": nodes,
        "warehouses": num_warehouses,
        "consumers": len(consumers),
        "rows_per_s": args.steps * rows_per_step / seconds,
        "mb_per_s": moved / seconds / 1e6,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "driver_bytes": through_driver // args.steps,
        "prompt_bytes": prompt_bytes // args.steps,
        "mb_per_step": moved / args.steps / 1e6,
        # the metadata path: ops the controller served per second, and the share of wall time it was busy
        # (near 1, the controller is the limit); single/driver mode: the one store's
        "controller_ops_per_s": served[0] / seconds,
        "controller_busy": served[1] / seconds,
        # dock mode: the share of the bytes consumers got that came from a warehouse on their own node
        "near_share": consumer_got_near / consumer_got if mode == "dock" and consumer_got else None,
    }
