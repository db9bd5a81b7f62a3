"""`dockrl bench train`: GRPO runs across an emulated multi-node cluster, in dock mode and in driver mode.

```
 node0 (head)            node1              node2              node3 (or node0 with 3 nodes)
 driver, warehouse 0     actor rank 0       actor rank 1       RewardWorker
                         warehouse 1        warehouse 2        warehouse 3
 every node behind its own --link-mbit link (bench/netem.py); the driver too
```

For each `--modes` entry it runs `dockrl train` (the tests' tiny Qwen2 model and the arithmetic task unless
`--config` and overrides say otherwise) inside the head node's namespace, with `run.ray_address` at the head,
`placement.actor` and `placement.reward` as drawn above and one warehouse per node. Reported per mode, from the
run's metrics.jsonl: the mean step time over the steps after the first (start-up and first-touch excluded), the
bytes that passed through the driver and the bytes the dock moved per step, the last reward, and which node
each worker ran on (the run summary's `worker_nodes`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from dockrl.observe import metric_names as names

# A GRPO step of the tests' size: 2 actor ranks (dp=2), 8 prompts x 4 samples.
BASE_CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 16, groups_per_pull: 2}\n"
    "actor: {dp: 2, lr: 1.0e-3, micro_batch_size: 8}\n"
    "reward: {functions: [{name: exact_answer}]}\n"
    "dock: {get_timeout_s: 300}\n"
    "run: {steps: 4, prompts_per_step: 8, progress: false, worker_timeout_s: 600, log_samples: 0}\n"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench train`."""
    parser.add_argument("--emulate-nodes", type=int, default=4, help="emulated nodes (3 or more)")
    parser.add_argument("--link-mbit", type=float, default=200.0, help="each node's link, each way (mbit/s)")
    parser.add_argument("--modes", default="dock,driver", help="comma list of dock.mode values to compare")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first is not timed)")
    parser.add_argument("--config", default=None, help="a train YAML instead of the built-in tiny GRPO step")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on each run")
    parser.add_argument("overrides", nargs="*", help="train overrides, e.g. rollout.max_new_tokens=64")


def placement(nodes: int) -> dict[str, list[str]]:
    """Actor ranks on nodes 1 and 2, the reward worker on node 3 (on the head when there are only 3)."""
    if nodes < 3:
        raise SystemExit(f"dockrl bench train: --emulate-nodes={nodes}; the layout needs at least 3 nodes")
    return {"actor": ["node1", "node2"], "reward": ["node3" if nodes > 3 else "node0"]}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per mode."""
    from dockrl.bench.netem import EmulatedCluster, unavailable
    from dockrl.bench.train_runs import tiny_workspace, train_argv

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"dockrl bench train: {reason}")
    place = placement(args.emulate_nodes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-train-") as tmp:
        root = Path(tmp)
        config = Path(args.config) if args.config else root / "grpo.yaml"
        if not args.config:
            config.write_text(BASE_CONFIG)
        model, data = tiny_workspace(root)
        with EmulatedCluster(nodes=args.emulate_nodes, link_mbit=args.link_mbit) as cluster:
            for mode in args.modes.split(","):
                argv = train_argv(
                    config,
                    model,
                    data,
                    root,
                    mode,
                    f"run.ray_address={cluster.head_address}",
                    f"run.steps={args.steps}",
                    f"dock.mode={mode}",
                    f"placement.actor=[{','.join(place['actor'])}]",
                    f"placement.reward=[{','.join(place['reward'])}]",
                    *args.overrides,
                )
                done = cluster.run_in(0, argv, timeout=args.timeout_s)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"dockrl train (dock.mode={mode}) on {args.emulate_nodes} emulated nodes failed "
                        f"(exit {done.returncode}):\n{done.stderr[-3000:]}"
                    )
                rows.append({**_row(root / "runs" / mode, mode, args), "node_ips": list(cluster.node_ips)})
    return rows


def _row(run_dir: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from dockrl.bench.train_runs import mean_after_first, read_run

    metrics, summary = read_run(run_dir)

    def mean(key: str) -> float:
        return mean_after_first(metrics, key)

    return {
        "mode": mode,
        "nodes": args.emulate_nodes,
        "link_mbit": args.link_mbit,
        "steps": len(metrics),
        "step_s": mean(names.TIMING_STEP),
        "driver_bytes": mean(names.DOCK_DRIVER_BYTES),
        "dock_bytes_moved": mean(names.DOCK_BYTES_MOVED),
        "reward_mean": metrics[-1][names.REWARD_MEAN],
        "worker_nodes": summary["worker_nodes"],
    }
