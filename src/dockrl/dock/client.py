"""Dock client: what the driver and every worker use to put and get rows (the Ray edge of the dock).

```
 put:  client --put(rows, batch)--> home warehouse  ]  both sent at once, both waited for: 1 round trip;
       client --mark_ready(rows, cols, lengths)--> controller ]  a get racing the payload waits at the warehouse
 get:  client --wait_poll(consumer, cols, n)--> controller (a long poll: answered the moment rows are
                                                           served, or after HEALTH_CHECK_S to re-check)
       client --get_cells--> warehouse 0 ]
       client --get_cells--> warehouse 1 ]  in parallel, one call per warehouse holding part of the rows
```

The client holds only actor handles, socket endpoints and settings, so it pickles into Ray tasks and actors.
Requests go over direct sockets to each actor's hub (or as Ray actor calls without endpoints; see
transport.py). Payload moves between the caller's process and the warehouses; it never passes the controller. Tensors and
arrays travel sealed (cells.py): sealed at put, unsealed at get, stored undecoded in between.

Failures: a dead controller or warehouse raises WarehouseDiedError naming the actor and the rows it held;
a consumer waiting for rows pings the warehouses every HEALTH_CHECK_S, so a warehouse that dies mid-step
is reported within seconds, not at the get timeout. A dock re-created under the same names (or an actor
restarted by Ray, which comes back empty) makes old handles stale: StaleHandleError says so.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any, cast

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dockrl.dock.api import DockAPI, Pull
from dockrl.dock.cells import seal_batch, unseal_batch
from dockrl.dock.columns import LABEL, PROMPT_IDS, check_columns, check_get, check_put
from dockrl.dock.errors import DockError, DockTimeoutError, StaleHandleError, WarehouseDiedError
from dockrl.dock.metrics import ClientCounters, batch_nbytes
from dockrl.dock.stages import Stage, as_stage
from dockrl.dock.transport import BadMessage, Lost, NoReply, RayTransport, SocketTransport
from dockrl.dock.warehouse import check_batch, lengths_of

HEALTH_CHECK_S = 2.0


class DockClient(ClientCounters, DockAPI):
    """Puts and gets rows of the current step's table (dock mode's DockAPI, see api.py).

    Args:
        controller: handle to the DockController actor.
        warehouses: handles to the Warehouse actors, by warehouse index.
        warehouse_nodes: Ray node id of each warehouse; used to pick `home` on the caller's node.
        home: index of the warehouse this client puts to. None: a warehouse on the node of the process
            that uses the client (resolved lazily, and again after the client is pickled to another
            process), else warehouse 0.
        get_timeout_s: default wait for `get`, and the bound on every other dock round trip.
        names: Ray actor names of [controller, *warehouses]; incarnations: their incarnation ids at launch
            (both optional; with them the client tells a re-created dock from a dead one).
        endpoints: socket (address, authkey) of [controller, *warehouses]; None: Ray actor calls.

    Counters of this process's client (`bytes_put`, `bytes_got`, `latency`) start at 0 wherever the client
    is unpickled; the driver's are the "bytes through the driver".

    get/put/stats may be called from several threads; add_groups (round-robin cursor) from one at a time.
    """

    def __init__(
        self,
        controller: Any,
        warehouses: list,
        *,
        warehouse_nodes: list[str] | None = None,
        home: int | None = None,
        get_timeout_s: float = 300.0,
        names: list[str] | None = None,
        incarnations: list[str] | None = None,
        endpoints: list[tuple[tuple, bytes]] | None = None,
    ) -> None:
        if not warehouses:
            raise ValueError("DockClient needs at least one warehouse handle")
        if warehouse_nodes is not None and len(warehouse_nodes) != len(warehouses):
            raise ValueError(f"{len(warehouse_nodes)} warehouse_nodes for {len(warehouses)} warehouses")
        if home is not None and not 0 <= home < len(warehouses):
            raise ValueError(f"home={home} is not a warehouse index in [0, {len(warehouses)})")
        self.controller = controller
        self.warehouses = list(warehouses)
        self.warehouse_nodes = list(warehouse_nodes) if warehouse_nodes is not None else None
        self.get_timeout_s = get_timeout_s
        self._home_setting = home
        self._home = home
        self._near: list[int] | None = None  # resolved on first use, in the process that uses the client
        self._next_warehouse = 0  # round-robin cursor for add_groups
        self.names = names
        self.incarnations = incarnations
        actors = [controller, *self.warehouses]
        if endpoints is not None and len(endpoints) != len(actors):
            raise ValueError(f"{len(endpoints)} endpoints for a controller and {len(warehouses)} warehouses")
        transports = (
            [RayTransport(a) for a in actors]
            if endpoints is None
            else [SocketTransport(address, key) for address, key in endpoints]
        )
        self._controller_transport, self._warehouse_transports = transports[0], transports[1:]
        self._reset_counters()

    def _reset_counters(self) -> None:
        super()._reset_counters()
        self.bytes_got_near = 0  # of bytes_got, what came from a warehouse on this process's node

    def client_stats(self) -> dict:
        """ClientCounters' figures plus bytes_got_near (read from a warehouse on this process's node)."""
        return {**super().client_stats(), "bytes_got_near": self.bytes_got_near}

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_near"] = None  # re-resolve on the node of the process that unpickles us
        if self._home_setting is None:
            state["_home"] = None
        return state

    @property
    def home(self) -> int:
        """Index of the warehouse `put` writes to: one on this process's node (with several there, chosen by
        process id, so the node's producers spread over them), else warehouse 0."""
        if self._home is None:
            near = self.near
            self._home = near[os.getpid() % len(near)] if near else 0
        return self._home

    @property
    def near(self) -> list[int]:
        """The warehouses on this process's node (sent with every get: the `local` policy serves rows held
        there first); [] when none is, or the warehouses' nodes are not known."""
        if self._near is None:
            self._near = []
            if self.warehouse_nodes is not None:
                node = ray.get_runtime_context().get_node_id()
                self._near = [w for w, n in enumerate(self.warehouse_nodes) if n == node]
        return self._near

    # ---------------------------------------------------------------- producers

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """Add one group of `group_size` rows per prompt; returns all row ids (group i = rows[i*g:(i+1)*g]).

        Each row gets `prompt_ids` (its prompt), `label`, and one value per prompt of every `extra` column.
        Groups are spread round-robin over the warehouses (the driver is not a producer node).
        """
        extra = extra or {}
        check_put(Stage.DRIVER, [PROMPT_IDS, LABEL, *extra], "add_groups")
        for name, values in {"labels": labels, **extra}.items():
            if len(values) != len(prompts):
                raise ValueError(f"add_groups: {name} has {len(values)} values for {len(prompts)} prompts")
        if not prompts:
            return []
        rows = self._call_controller("add_groups", [group_size] * len(prompts), [len(p) for p in prompts])
        per_prompt = {PROMPT_IDS: prompts, LABEL: labels, **extra}
        puts: dict[int, tuple[list[int], dict[str, list]]] = {}
        for group in range(len(prompts)):
            warehouse = (self._next_warehouse + group) % len(self.warehouses)
            group_rows, batch = puts.setdefault(warehouse, ([], defaultdict(list)))
            group_rows.extend(rows[group * group_size : (group + 1) * group_size])
            for column, values in per_prompt.items():
                batch[column].extend([values[group]] * group_size)
        self._next_warehouse = (self._next_warehouse + len(prompts)) % len(self.warehouses)
        self._put_many({w: (r, seal_batch(b)) for w, (r, b) in puts.items()})
        self.bytes_put += sum(batch_nbytes(b) for _, b in puts.values())
        return rows

    def put(self, producer: Stage, rows: list[int], batch: dict[str, list]) -> None:
        """Stage `producer` writes `batch[column][i]` for row `rows[i]` to the home warehouse; visible to `get`
        on return. A column `producer` does not write (columns.py) is refused before any request."""
        t0 = time.perf_counter()
        check_put(producer, batch)
        check_batch(rows, batch, "the dock")
        self._put_many({self.home: (rows, seal_batch(batch))})
        self.bytes_put += batch_nbytes(batch)
        self.latency.record("put", time.perf_counter() - t0)

    def _put_many(self, puts: dict[int, tuple[list[int], dict[str, list]]]) -> None:
        """Payload to each warehouse and its metadata to the controller, all in flight at once."""
        refs = {w: self._request(w, "put", rows, batch) for w, (rows, batch) in puts.items()}
        marks = [
            self._controller_transport.request("mark_ready", w, rows, list(batch), lengths_of(batch) or None)
            for w, (rows, batch) in puts.items()
            if rows and batch
        ]
        collected = 0
        try:
            self._gather(refs, {w: rows for w, (rows, _) in puts.items()}, "put")
            for mark in marks:
                self._controller_result(mark, "mark_ready")
                collected += 1
        except BaseException:
            for mark in marks[collected:]:
                mark.abandon()  # a reply left unread would answer this thread's next controller call
            raise

    # ---------------------------------------------------------------- consumers

    def pull(self, request: Pull) -> tuple[list[int], dict[str, list]] | None:
        """Take the rows of `request` (a Pull; see DockController.allocate) and fetch their columns.

        Blocks until served; returns (rows, {column: values in row order}), or None once the consumer has
        consumed every row of the table. Raises DockError at once for a column the consumer does not read
        (columns.py), DockTimeoutError after the request's timeout (default get_timeout_s), WarehouseDiedError
        as soon as a health check finds a dead warehouse.
        """
        columns, count = request.columns, request.count
        name = check_get(request.consumer, columns).value  # the controller keys its bitmaps by the plain name
        timeout_s = self.get_timeout_s if request.timeout_s is None else request.timeout_s
        start = time.monotonic()
        deadline = start + timeout_s
        options: dict[str, Any] = dict(
            whole_groups=request.whole_groups, min_count=request.min_count, balance_over=request.balance_over
        )
        options.update({"policy": request.policy} if request.policy is not None else {})
        options.update({"peer": request.peer} if request.peer is not None else {})
        options.update({"near": self.near} if self.near else {})
        while True:
            wait_s = max(0.0, min(HEALTH_CHECK_S, deadline - time.monotonic()))
            allocation, done = self._call_controller(
                "wait_poll",
                name,
                columns,
                count,
                wait_s,
                reply_timeout_s=wait_s + self.get_timeout_s,  # the long poll itself takes up to wait_s
                **options,
            )
            if allocation is not None:
                batch = self._fetch(name, allocation)
                self.latency.record("get", time.monotonic() - start)
                return allocation.rows, batch
            if done:
                return None
            if time.monotonic() >= deadline:
                raise self._timeout_error(
                    name, columns, count, request.whole_groups, request.min_count, timeout_s
                )
            self.check_warehouses()  # a dead warehouse is named within HEALTH_CHECK_S, not at the timeout

    def peek(self, columns: list[str]) -> tuple[list[int], dict[str, list]]:
        """Every row whose `columns` are all ready, with their values, consuming nothing (see
        DockController.peek): (rows ascending, {column: values in row order}); no wait."""
        check_columns(columns, "peek")
        allocation = self._call_controller("peek", columns)
        if not allocation.rows:
            return [], {column: [] for column in columns}
        return allocation.rows, self._fetch("a peek", allocation)

    def _fetch(self, consumer: str, allocation) -> dict[str, list]:
        """One get_cells call per warehouse holding part of the allocation, reassembled in row order."""
        requests: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        positions: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for column, locations in allocation.locations.items():
            for position, (row, warehouse) in enumerate(zip(allocation.rows, locations)):
                requests[warehouse][column].append(row)
                positions[warehouse][column].append(position)
        refs = {w: self._request(w, "get_cells", dict(req)) for w, req in requests.items()}
        rows_by_warehouse = {
            w: sorted({r for rows in req.values() for r in rows}) for w, req in requests.items()
        }
        results = self._gather(refs, rows_by_warehouse, f"get for consumer {consumer!r}")
        out: dict[str, list] = {column: [None] * len(allocation.rows) for column in allocation.locations}
        for warehouse, cells in results.items():
            for column, values in cells.items():
                for position, value in zip(positions[warehouse][column], values):
                    out[column][position] = value
            if warehouse in self.near:
                self.bytes_got_near += batch_nbytes(cells)
        self.bytes_got += batch_nbytes(out)
        return unseal_batch(out)

    def _timeout_error(
        self,
        consumer: str,
        columns: list[str],
        count: int,
        whole_groups: bool,
        min_count: int | None,
        timeout_s: float,
    ) -> DockTimeoutError:
        stats = self._call_controller("stats")
        ready = {column: stats["ready"].get(column, 0) for column in columns}
        consumed = stats["consumed"].get(consumer, 0)
        waiting = self._call_controller("unready_rows", columns)
        return DockTimeoutError(
            f"dock get timed out after {timeout_s:g}s: consumer {consumer!r} asked for {count} rows "
            f"(min_count={min_count}, whole_groups={whole_groups}) of columns {list(columns)}; "
            f"ready rows per column: {ready}; consumed by {consumer!r}: {consumed} of "
            f"{stats['num_rows']} rows; rows not ready: {waiting}. Is the producer of the missing columns "
            "running? (raise dock.get_timeout_s if it is just slow)"
        )

    def drop(self, rows: list[int]) -> int:
        """Take rows out of the step (see DockController.drop); their payload stays until the reset."""
        return self._call_controller("drop", rows)

    def all_consumed(self, consumer: Stage) -> bool:
        """True iff the table has rows and `consumer` has taken them all."""
        return self._call_controller("all_consumed", as_stage(consumer, "all_consumed: consumer").value)

    # ---------------------------------------------------------------- driver

    def ages(self) -> list[int]:
        """Each row's age (resets survived; partial rollout's carried groups), in row order."""
        return self._call_controller("ages")

    def stats(self) -> dict:
        """Controller stats plus "warehouses" (the stats of every warehouse, by index), "mode": "dock" and
        "client" (this client's bytes_put, bytes_got and latency_ms; the driver's = bytes through the driver).
        """
        stats = self._call_controller("stats")
        refs = {w: self._request(w, "stats") for w in range(len(self.warehouses))}
        warehouse_stats = self._gather(refs, {w: [] for w in refs}, "stats")
        stats["warehouses"] = [warehouse_stats[w] for w in range(len(self.warehouses))]
        stats["mode"] = "dock"
        stats["client"] = self.client_stats()
        return stats

    def reset(self, keep_unfinished: str | None = None, served_by: Stage | None = None) -> list[int]:
        """Start the next step's table: controller reset, then every warehouse cleared. Call between steps.

        keep_unfinished: a column name; groups with a row lacking it survive, renumbered (partial rollout,
        see DockController.reset; `served_by`: the consumer their rows with it count as served to). Returns
        the kept old row ids (new id = index). Checks for stale handles.
        """
        self.check_handles()
        served = None if served_by is None else as_stage(served_by, "reset: served_by").value
        kept = self._call_controller("reset", keep_unfinished, served)
        refs = {w: self._request(w, "clear", kept) for w in range(len(self.warehouses))}
        self._gather(refs, {w: [] for w in refs}, "clear")
        self.bytes_put = self.bytes_got = self.bytes_got_near = 0
        return kept

    # ---------------------------------------------------------------- failures

    def check_warehouses(self) -> None:
        """Ping every warehouse; a dead one raises WarehouseDiedError naming it and the rows it held."""
        refs = {w: self._request(w, "ping") for w in range(len(self.warehouses))}
        self._gather(refs, None, "a health check")

    def check_handles(self) -> None:
        """Raise StaleHandleError if an actor this client talks to is no longer the one it was given."""
        if self.incarnations is None:
            return
        actors = [self.controller, *self.warehouses]
        for i, (actor, expected) in enumerate(zip(actors, self.incarnations)):
            what = "dock controller" if i == 0 else self._describe(i - 1)
            try:
                current = ray.get(actor.get_incarnation.remote(), timeout=self.get_timeout_s)
            except RayActorError:
                current = self._replacement(i)
                if current is None:
                    raise WarehouseDiedError(f"{what} died (found by a handle check)") from None
            if current != expected:
                raise StaleHandleError(
                    f"{what} was restarted (incarnation {expected[:8]} -> {current[:8]}): its table is "
                    "gone and this client's handles are stale; take a new client from the new dock "
                    "(dock.client()) and add the step's prompts again"
                )

    def _replacement(self, i: int) -> str | None:
        """Incarnation of a live actor registered under the same name as actor i, if any."""
        if self.names is None:
            return None
        try:
            actor = ray.get_actor(self.names[i])
            return cast(str, ray.get(actor.get_incarnation.remote(), timeout=self.get_timeout_s))
        except (ValueError, RayActorError, GetTimeoutError):
            return None

    # ---------------------------------------------------------------- Ray plumbing

    def _call_controller(self, method: str, *args, reply_timeout_s: float | None = None, **kwargs) -> Any:
        pending = self._controller_transport.request(method, *args, **kwargs)
        return self._controller_result(pending, method, reply_timeout_s)

    def _controller_result(self, pending: Any, method: str, timeout_s: float | None = None) -> Any:
        timeout_s = self.get_timeout_s if timeout_s is None else timeout_s
        try:
            return pending.result(timeout_s)
        except BadMessage as error:
            raise DockError(
                f"dock controller's reply to {method} could not be unpickled here: {error}"
            ) from error
        except Lost as error:
            if self.names is not None and self._replacement(0) is not None:
                self.check_handles()  # raises StaleHandleError: the dock was re-created
            raise WarehouseDiedError(
                f"dock controller died during {method}; every row of the step's table is lost (its "
                f"metadata lived there). Restart the run (or the dock and the step). Cause: {error}"
            ) from error
        except NoReply as error:
            raise DockTimeoutError(
                f"dock controller did not answer {method} within {timeout_s:g}s"
            ) from error

    def _request(self, warehouse: int, method: str, *args) -> Any:
        """Send one call to a warehouse; a send that fails is reported when its reply is collected."""
        return self._warehouse_transports[warehouse].request(method, *args)

    def _gather(self, refs: dict[int, Any], rows: dict[int, list[int]] | None, what: str) -> dict[int, Any]:
        """Collect each warehouse's reply (all already in flight), naming the warehouse that failed.

        rows: the rows each call concerned; None (or empty) names every row the controller placed there.
        """
        deadline = time.monotonic() + self.get_timeout_s
        results = {}
        try:
            for warehouse, ref in refs.items():
                results[warehouse] = self._collect(warehouse, ref, deadline, rows, what)
        except BaseException:
            for warehouse, ref in refs.items():
                if warehouse not in results:
                    ref.abandon()  # a reply left unread would answer this thread's next call there
            raise
        return results

    def _collect(self, warehouse: int, ref: Any, deadline: float, rows: dict | None, what: str) -> Any:
        try:
            return ref.result(deadline - time.monotonic())
        except BadMessage as error:
            raise DockError(
                f"{self._describe(warehouse)}'s reply to {what} could not be unpickled here: {error}"
            ) from error
        except Lost as error:
            if self.names is not None and self._replacement(1 + warehouse) is not None:
                self.check_handles()  # raises StaleHandleError: the dock was re-created
            affected = (rows or {}).get(warehouse) or self._rows_on(warehouse)
            raise WarehouseDiedError(
                f"{self._describe(warehouse)} died during {what}; rows affected: "
                f"{_abbreviate(affected)}. Their payload is lost: restart the step. Cause: {error}"
            ) from error
        except NoReply as error:
            raise DockTimeoutError(
                f"{self._describe(warehouse)} did not answer {what} within {self.get_timeout_s:g}s; "
                f"rows: {_abbreviate((rows or {}).get(warehouse, []))}"
            ) from error

    def _rows_on(self, warehouse: int) -> list[int]:
        try:
            return self._call_controller("rows_on", warehouse)
        except DockError:
            return []

    def _describe(self, warehouse: int) -> str:
        node = self.warehouse_nodes[warehouse] if self.warehouse_nodes is not None else "unknown"
        return f"dock warehouse {warehouse} on node {node}"


def _abbreviate(rows: list[int], limit: int = 16) -> str:
    if len(rows) <= limit:
        return str(list(rows))
    return f"{list(rows[:limit])} and {len(rows) - limit} more"
