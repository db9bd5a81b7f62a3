"""Start the dock on a Ray cluster: one controller actor and the warehouse actors (the dock's Ray shell).

```
 mode=dock   : controller (driver's node) + warehouse i on node i mod num_nodes   -> Dock, DockClient
 mode=single : one replay-buffer actor (controller + warehouse), socket or Ray calls -> CentralDockHandle
 mode=driver : controller + warehouse inside the driver process, socket hub       -> CentralDockHandle
```

Placement: the controller runs on the driver's node; warehouse i runs on node i mod num_nodes, the
driver's node first, so by default every node has exactly one warehouse and producers write on-node.

Requests (transport.py): with `transport="socket"` (default) every actor also runs a socket hub and clients
connect to it directly; with "ray" they make Ray actor calls. Either way the actors are Ray actors.

Concurrency: the controller (SharedController) runs every method under one lock, so `allocate` is atomic;
consumers long-poll (`wait_poll`) and wake the moment a put, a new group or a reset changes the table.
Neither the controller nor a warehouse calls anyone: a client sends a put's payload to its warehouse and
its metadata to the controller at once, and a consumer served those rows early waits at the warehouse for
the payload (at most IN_FLIGHT_S). Warehouses are threaded (their storage has a lock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dockrl.dock.central import ActorTransport, CentralClient, CentralDock, HubTransport
from dockrl.dock.client import DockClient
from dockrl.dock.errors import DockError
from dockrl.dock.remote import remote_class
from dockrl.dock.shared import SharedController
from dockrl.dock.transport import ServiceHub
from dockrl.dock.warehouse import Warehouse

WAREHOUSE_MAX_CONCURRENCY = 64  # transport=ray: gets waiting for in-flight cells hold a thread each
CONTROLLER_MAX_CONCURRENCY = 64  # transport=ray: a waiting get holds a thread (long poll)
SINGLE_MAX_CONCURRENCY = 64  # single mode: waiting gets hold a thread each (long poll), puts need one free
STARTUP_TIMEOUT_S = 120.0
IN_FLIGHT_S = 60.0  # a get waits this long at a warehouse for a payload whose put is still in flight
MODES = ("dock", "single", "driver")
TRANSPORTS = ("socket", "ray")


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
    endpoints: list[tuple[tuple, bytes]] | None = None  # socket (address, key) of [controller, *warehouses]

    def client(self, **kwargs) -> DockClient:
        """A DockClient for this dock; kwargs override DockClient's (home, get_timeout_s)."""
        kwargs.setdefault("get_timeout_s", self.get_timeout_s)
        return DockClient(
            self.controller,
            self.warehouses,
            warehouse_nodes=self.warehouse_nodes,
            names=self.names,
            incarnations=self.incarnations,
            endpoints=self.endpoints,
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
    hub: ServiceHub | None = None

    def client(self, **kwargs) -> CentralClient:
        """A CentralClient (DockClient's interface); kwargs: get_timeout_s (home is ignored)."""
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
    transport: str = "socket",
) -> Dock | CentralDockHandle:
    """Start the dock and wait for it. mode: dock (default; controller + `num_warehouses` warehouses, default
    one per alive node), single (one replay-buffer actor) or driver (store inside this process).

    Actors are named f"{name_prefix}-controller" and f"{name_prefix}-warehouse-{i}" (single mode:
    f"{name_prefix}-buffer") and use no CPUs. policy and max_rows: see DockController. transport (dock
    mode): "socket" (clients connect straight to each actor) or "ray" (Ray actor calls), see transport.py.
    """
    if not ray.is_initialized():
        raise DockError("launch_dock needs a running Ray runtime; call ray.init() first")
    if mode not in MODES:
        raise ValueError(f"dock.mode={mode!r} is not one of {list(MODES)}")
    if transport not in TRANSPORTS:
        raise ValueError(f"dock.transport={transport!r} is not one of {list(TRANSPORTS)}")
    if mode == "driver":
        hub = ServiceHub(CentralDock(policy=policy, max_rows=max_rows), host=ray.util.get_node_ip_address())
        hub_transport = HubTransport(hub.address, hub.authkey, get_timeout_s)
        return CentralDockHandle(mode, hub_transport, get_timeout_s, hub=hub)
    # Actor handles are Any: Ray's stubs type a handle's methods as the plain methods, without `.remote`.
    if mode == "single":
        actor: Any = (
            remote_class(CentralDock)
            .options(name=f"{name_prefix}-buffer", num_cpus=0, max_concurrency=SINGLE_MAX_CONCURRENCY)
            .remote(policy=policy, max_rows=max_rows)
        )
        ray.get(actor.stats.remote(), timeout=STARTUP_TIMEOUT_S)
        if transport == "socket":  # the same direct connections as dock mode, to the one actor
            address, authkey = ray.get(actor.serve.remote(None), timeout=STARTUP_TIMEOUT_S)
            owner = "the dock's single replay-buffer actor"
            hub_transport = HubTransport(address, authkey, get_timeout_s, owner=owner)
            return CentralDockHandle(mode, hub_transport, get_timeout_s, actor=actor)
        return CentralDockHandle(mode, ActorTransport(actor, get_timeout_s), get_timeout_s, actor=actor)
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda node: node != driver_node)
    num_warehouses = len(nodes) if num_warehouses is None else num_warehouses
    if num_warehouses < 1:
        raise ValueError(f"num_warehouses={num_warehouses} must be >= 1 (or None for one per node)")

    controller: Any = (
        remote_class(SharedController)
        .options(
            name=f"{name_prefix}-controller",
            num_cpus=0,
            max_concurrency=CONTROLLER_MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=True),
        )
        .remote(num_warehouses, policy=policy, max_rows=max_rows)
    )
    endpoints: list[tuple[tuple, bytes]] | None = None
    warehouse_nodes = [nodes[i % len(nodes)] for i in range(num_warehouses)]
    warehouse_class = remote_class(Warehouse)
    warehouses: list[Any] = [
        warehouse_class.options(
            name=f"{name_prefix}-warehouse-{i}",
            num_cpus=0,
            max_concurrency=WAREHOUSE_MAX_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(i, in_flight_s=IN_FLIGHT_S)
        for i, node in enumerate(warehouse_nodes)
    ]
    if transport == "socket":  # every actor starts at once; None: each hub binds to its node's address
        endpoints = ray.get(
            [a.serve.remote(None) for a in (controller, *warehouses)], timeout=STARTUP_TIMEOUT_S
        )
    incarnations = ray.get(
        [a.get_incarnation.remote() for a in (controller, *warehouses)], timeout=STARTUP_TIMEOUT_S
    )
    names = [f"{name_prefix}-controller", *(f"{name_prefix}-warehouse-{i}" for i in range(num_warehouses))]
    return Dock(
        controller, warehouses, warehouse_nodes, get_timeout_s, names, incarnations, endpoints=endpoints
    )
