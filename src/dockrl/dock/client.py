"""Dock client: what the driver and every worker use to put and get rows (the Ray edge of the dock).

```
 put:  client --put(rows, batch)--> home warehouse --mark_ready--> controller      (1 round trip, waited)
 get:  client --poll(consumer, cols, n)--> controller     (repeated with backoff until served)
       client --get_cells--> warehouse 0 ]
       client --get_cells--> warehouse 1 ]  in parallel, one call per warehouse holding part of the rows
```

The client holds only actor handles and settings, so it pickles into Ray tasks and actors. Payload moves
between the caller's process and the warehouses through Ray's object store; it never passes the controller.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dockrl.dock.errors import DockTimeoutError, WarehouseDiedError

MAX_POLL_INTERVAL_S = 0.1
POLL_BACKOFF = 1.5


class DockClient:
    """Puts and gets rows of the current step's table.

    Args:
        controller: handle to the DockController actor.
        warehouses: handles to the Warehouse actors, by warehouse index.
        warehouse_nodes: Ray node id of each warehouse; used to pick `home` on the caller's node.
        home: index of the warehouse this client puts to. None: the first warehouse on the node of the
            process that uses the client (resolved lazily, and again after the client is pickled to
            another process), else warehouse 0.
        get_timeout_s: default wait for `get`, and the bound on every other dock round trip.
        poll_interval_s: first wait between allocation polls; grows to 0.1 s.

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
        poll_interval_s: float = 0.01,
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
        self.poll_interval_s = poll_interval_s
        self._home_setting = home
        self._home = home
        self._next_warehouse = 0  # round-robin cursor for add_groups

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self._home_setting is None:
            state["_home"] = None  # re-resolve on the node of the process that unpickles us
        return state

    @property
    def home(self) -> int:
        """Index of the warehouse `put` writes to."""
        if self._home is None:
            self._home = 0
            if self.warehouse_nodes is not None:
                node = ray.get_runtime_context().get_node_id()
                if node in self.warehouse_nodes:
                    self._home = self.warehouse_nodes.index(node)
        return self._home

    # ---------------------------------------------------------------- producers

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """Add one group of `group_size` rows per prompt; returns all row ids (group i = rows[i*g:(i+1)*g]).

        Each row gets `prompt_ids` (its prompt), `label`, and one value per prompt of every `extra` column.
        Groups are spread round-robin over the warehouses (the driver is not a producer node).
        """
        extra = extra or {}
        for name, values in {"labels": labels, **extra}.items():
            if len(values) != len(prompts):
                raise ValueError(f"add_groups: {name} has {len(values)} values for {len(prompts)} prompts")
        if not prompts:
            return []
        rows = self._call_controller("add_groups", [group_size] * len(prompts), [len(p) for p in prompts])
        per_prompt = {"prompt_ids": prompts, "label": labels, **extra}
        puts: dict[int, tuple[list[int], dict[str, list]]] = {}
        for group in range(len(prompts)):
            warehouse = (self._next_warehouse + group) % len(self.warehouses)
            group_rows, batch = puts.setdefault(warehouse, ([], defaultdict(list)))
            group_rows.extend(rows[group * group_size : (group + 1) * group_size])
            for column, values in per_prompt.items():
                batch[column].extend([values[group]] * group_size)
        self._next_warehouse = (self._next_warehouse + len(prompts)) % len(self.warehouses)
        refs = {w: self.warehouses[w].put.remote(r, dict(b)) for w, (r, b) in puts.items()}
        self._gather(refs, {w: r for w, (r, _) in puts.items()}, "put")
        return rows

    def put(self, rows: list[int], batch: dict[str, list]) -> None:
        """Write `batch[column][i]` for row `rows[i]` to the home warehouse; visible to `get` on return."""
        home = self.home
        self._gather({home: self.warehouses[home].put.remote(rows, batch)}, {home: rows}, "put")

    # ---------------------------------------------------------------- consumers

    def get(
        self,
        consumer: str,
        columns: list[str],
        count: int,
        *,
        whole_groups: bool = False,
        min_count: int | None = None,
        timeout_s: float | None = None,
    ) -> tuple[list[int], dict[str, list]] | None:
        """Take up to `count` rows for `consumer` (see DockController.allocate) and fetch their `columns`.

        Blocks until served; returns (rows, {column: values in row order}), or None once `consumer` has
        consumed every row of the table. Raises DockTimeoutError after `timeout_s` (default get_timeout_s).
        """
        timeout_s = self.get_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        delay = self.poll_interval_s
        while True:
            allocation, done = self._call_controller(
                "poll", consumer, columns, count, whole_groups=whole_groups, min_count=min_count
            )
            if allocation is not None:
                return allocation.rows, self._fetch(consumer, allocation)
            if done:
                return None
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise self._timeout_error(consumer, columns, count, whole_groups, min_count, timeout_s)
            time.sleep(min(delay, remaining_s))
            delay = max(self.poll_interval_s, min(delay * POLL_BACKOFF, MAX_POLL_INTERVAL_S))

    def _fetch(self, consumer: str, allocation) -> dict[str, list]:
        """One get_cells call per warehouse holding part of the allocation, reassembled in row order."""
        requests: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        positions: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for column, locations in allocation.locations.items():
            for position, (row, warehouse) in enumerate(zip(allocation.rows, locations)):
                requests[warehouse][column].append(row)
                positions[warehouse][column].append(position)
        refs = {w: self.warehouses[w].get_cells.remote(dict(req)) for w, req in requests.items()}
        rows_by_warehouse = {
            w: sorted({r for rows in req.values() for r in rows}) for w, req in requests.items()
        }
        results = self._gather(refs, rows_by_warehouse, f"get for consumer {consumer!r}")
        out: dict[str, list] = {column: [None] * len(allocation.rows) for column in allocation.locations}
        for warehouse, cells in results.items():
            for column, values in cells.items():
                for position, value in zip(positions[warehouse][column], values):
                    out[column][position] = value
        return out

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
        return DockTimeoutError(
            f"dock get timed out after {timeout_s:g}s: consumer {consumer!r} asked for {count} rows "
            f"(min_count={min_count}, whole_groups={whole_groups}) of columns {list(columns)}; "
            f"ready rows per column: {ready}; consumed by {consumer!r}: {consumed} of "
            f"{stats['num_rows']} rows. Is the producer of the missing columns running?"
        )

    def all_consumed(self, consumer: str) -> bool:
        """True iff the table has rows and `consumer` has taken them all."""
        return self._call_controller("all_consumed", consumer)

    # ---------------------------------------------------------------- driver

    def stats(self) -> dict:
        """Controller stats plus "warehouses": the stats of every warehouse, by index."""
        stats = self._call_controller("stats")
        refs = {w: handle.stats.remote() for w, handle in enumerate(self.warehouses)}
        warehouse_stats = self._gather(refs, {w: [] for w in refs}, "stats")
        stats["warehouses"] = [warehouse_stats[w] for w in range(len(self.warehouses))]
        return stats

    def reset(self) -> None:
        """Forget the table: controller reset, then every warehouse cleared. Call between steps."""
        self._call_controller("reset")
        refs = {w: handle.clear.remote() for w, handle in enumerate(self.warehouses)}
        self._gather(refs, {w: [] for w in refs}, "clear")

    # ---------------------------------------------------------------- Ray plumbing

    def _call_controller(self, method: str, *args, **kwargs) -> Any:
        ref = getattr(self.controller, method).remote(*args, **kwargs)
        try:
            return ray.get(ref, timeout=self.get_timeout_s)
        except RayActorError as error:
            raise WarehouseDiedError(f"dock controller died during {method}: {error}") from error
        except GetTimeoutError as error:
            raise DockTimeoutError(
                f"dock controller did not answer {method} within {self.get_timeout_s:g}s"
            ) from error

    def _gather(self, refs: dict[int, Any], rows: dict[int, list[int]], what: str) -> dict[int, Any]:
        """ray.get each warehouse's reply (all already in flight), naming the warehouse that failed."""
        deadline = time.monotonic() + self.get_timeout_s
        results = {}
        for warehouse, ref in refs.items():
            try:
                results[warehouse] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except RayActorError as error:
                raise WarehouseDiedError(
                    f"{self._describe(warehouse)} died during {what}; rows affected: "
                    f"{_abbreviate(rows[warehouse])}. Cause: {error}"
                ) from error
            except GetTimeoutError as error:
                raise DockTimeoutError(
                    f"{self._describe(warehouse)} did not answer {what} within {self.get_timeout_s:g}s; "
                    f"rows: {_abbreviate(rows[warehouse])}"
                ) from error
        return results

    def _describe(self, warehouse: int) -> str:
        node = self.warehouse_nodes[warehouse] if self.warehouse_nodes is not None else "unknown"
        return f"dock warehouse {warehouse} on node {node}"


def _abbreviate(rows: list[int], limit: int = 16) -> str:
    if len(rows) <= limit:
        return str(list(rows))
    return f"{list(rows[:limit])} and {len(rows) - limit} more"
