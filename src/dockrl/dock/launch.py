"""Start the dock on a Ray cluster: one controller actor and the warehouse actors (the dock's Ray shell).

```
 mode=dock   : controller (driver's node) + warehouse i on node i mod num_nodes   -> Dock, DockClient
 mode=single : one replay-buffer actor (controller + warehouse)                  -> CentralDockHandle
 mode=driver : controller + warehouse inside the driver process, socket hub       -> CentralDockHandle
```

Placement: the controller runs on the driver's node; warehouse i runs on node i mod num_nodes, the
driver's node first, so by default every node has exactly one warehouse and producers write on-node.

Concurrency: the controller runs one method at a time (max_concurrency=1), which makes `allocate` atomic
without locks. Warehouses block on controller.mark_ready during a put; that cannot deadlock because the
controller never calls a warehouse. Warehouses are threaded (their storage has a lock) so that gets from
many consumers are served while a put waits for the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dockrl.dock.central import ActorTransport, CentralClient, CentralDock, DriverHub, HubTransport
from dockrl.dock.client import DockClient
from dockrl.dock.controller import DockController
from dockrl.dock.errors import DockError
from dockrl.dock.warehouse import Warehouse

WAREHOUSE_MAX_CONCURRENCY = 4
STARTUP_TIMEOUT_S = 120.0
MODES = ("dock", "single", "driver")


class RemoteController:
    """Blocking `mark_ready` over a controller actor handle: what a warehouse actor notifies after a put."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def mark_ready(
        self, warehouse: int, rows: list[int], columns: list[str], lengths: dict[str, list[int]] | None = None
    ) -> None:
        """Forward to the controller and wait, so the put's rows are allocatable when the put returns."""
        ray.get(self.handle.mark_ready.remote(warehouse, rows, columns, lengths), timeout=STARTUP_TIMEOUT_S)


@dataclass
class Dock:
    """Handles to a running dock.

    controller: the DockController actor. warehouses: Warehouse actors by index. warehouse_nodes: the Ray
    node id of each warehouse. get_timeout_s: default timeout of the clients made by `client()`.
    """

    controller: Any
    warehouses: list
    warehouse_nodes: list[str]
    get_timeout_s: float = 300.0
    names: list[str] | None = None
    incarnations: list[str] | None = None
    mode: str = "dock"

    def client(self, **kwargs) -> DockClient:
        """A DockClient for this dock; kwargs override DockClient's (home, get_timeout_s, poll_interval_s)."""
        kwargs.setdefault("get_timeout_s", self.get_timeout_s)
        return DockClient(
            self.controller,
            self.warehouses,
            warehouse_nodes=self.warehouse_nodes,
            names=self.names,
            incarnations=self.incarnations,
            **kwargs,
        )

    def shutdown(self) -> None:
        """Kill the controller and every warehouse (their data is lost)."""
        for actor in [self.controller, *self.warehouses]:
            try:
                ray.kill(actor)
            except ValueError:  # already dead or not an actor handle any more
                pass


@dataclass
class CentralDockHandle:
    """A running `single` or `driver` mode dock (see central.py); same `client()` / `shutdown()` as Dock."""

    mode: str
    transport: Any
    get_timeout_s: float = 300.0
    actor: Any = None
    hub: DriverHub | None = None

    def client(self, **kwargs) -> CentralClient:
        """A CentralClient (DockClient's interface); kwargs: get_timeout_s, poll_interval_s (home is ignored)."""
        kwargs.pop("home", None)
        kwargs.setdefault("get_timeout_s", self.get_timeout_s)
        return CentralClient(self.transport, self.mode, **kwargs)

    def shutdown(self) -> None:
        """Stop the replay-buffer actor or the driver hub (their data is lost)."""
        if self.actor is not None:
            ray.kill(self.actor)
        if self.hub is not None:
            self.hub.close()


def launch_dock(
    *,
    mode: str = "dock",
    num_warehouses: int | None = None,
    name_prefix: str = "dockrl",
    get_timeout_s: float = 300.0,
    policy: str = "first",
    max_rows: int | None = None,
) -> Dock | CentralDockHandle:
    """Start the dock and wait for it. mode: dock (default; controller + `num_warehouses` warehouses, default
    one per alive node), single (one replay-buffer actor) or driver (store inside this process).

    Actors are named f"{name_prefix}-controller" and f"{name_prefix}-warehouse-{i}" (single mode:
    f"{name_prefix}-buffer") and use no CPUs. policy and max_rows: see DockController.
    """
    if not ray.is_initialized():
        raise DockError("launch_dock needs a running Ray runtime; call ray.init() first")
    if mode not in MODES:
        raise ValueError(f"dock.mode={mode!r} is not one of {list(MODES)}")
    if mode == "driver":
        hub = DriverHub(CentralDock(policy=policy, max_rows=max_rows), host=ray.util.get_node_ip_address())
        return CentralDockHandle(mode, HubTransport(hub.address, hub.authkey), get_timeout_s, hub=hub)
    if mode == "single":
        actor = (
            ray.remote(CentralDock)
            .options(name=f"{name_prefix}-buffer", num_cpus=0, max_concurrency=WAREHOUSE_MAX_CONCURRENCY)
            .remote(policy=policy, max_rows=max_rows)
        )
        ray.get(actor.stats.remote(), timeout=STARTUP_TIMEOUT_S)
        return CentralDockHandle(mode, ActorTransport(actor, get_timeout_s), get_timeout_s, actor=actor)
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda node: node != driver_node)
    num_warehouses = len(nodes) if num_warehouses is None else num_warehouses
    if num_warehouses < 1:
        raise ValueError(f"num_warehouses={num_warehouses} must be >= 1 (or None for one per node)")

    controller = (
        ray.remote(DockController)
        .options(
            name=f"{name_prefix}-controller",
            num_cpus=0,
            max_concurrency=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=True),
        )
        .remote(num_warehouses, policy=policy, max_rows=max_rows)
    )
    warehouse_nodes = [nodes[i % len(nodes)] for i in range(num_warehouses)]
    warehouse_class = ray.remote(Warehouse)
    warehouses = [
        warehouse_class.options(
            name=f"{name_prefix}-warehouse-{i}",
            num_cpus=0,
            max_concurrency=WAREHOUSE_MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(i, RemoteController(controller))
        for i, node in enumerate(warehouse_nodes)
    ]
    incarnations = ray.get(
        [a.get_incarnation.remote() for a in (controller, *warehouses)], timeout=STARTUP_TIMEOUT_S
    )
    names = [f"{name_prefix}-controller", *(f"{name_prefix}-warehouse-{i}" for i in range(num_warehouses))]
    return Dock(controller, warehouses, warehouse_nodes, get_timeout_s, names, incarnations)
