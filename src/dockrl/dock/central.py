"""Comparison modes of the dock: data and metadata in ONE place, behind the same client interface.

```
 single:  worker --put/get--> [ReplayBuffer actor: controller + one warehouse] <--put/get-- worker
 driver:  worker --put/get--> [driver process: controller + one warehouse, socket hub] <-- worker
          (the single-controller design: every byte of payload passes through the driver)
```

`CentralDock` is the store (a DockController and a Warehouse in one object, one lock). In `single` mode it
is a Ray actor; in `driver` mode it lives in the driver process and a ServiceHub (transport.py, the same hub
the dock's actors use) serves it to workers over authenticated connections. `CentralClient` offers the DockAPI (api.py;
add_groups, put, get, all_consumed, stats, reset, ...) over either transport, so recipes and benchmarks do not
care which mode runs. Used for benchmarks and as a fallback; `dock` mode is the scalable one.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

from dockrl.dock.api import DockAPI, Pull
from dockrl.dock.cells import seal_batch, unseal_batch
from dockrl.dock.columns import LABEL, PROMPT_IDS, check_columns, check_get, check_put
from dockrl.dock.errors import DockError, DockTimeoutError, WarehouseDiedError
from dockrl.dock.metrics import ClientCounters, batch_nbytes
from dockrl.dock.shared import SharedController
from dockrl.dock.stages import Stage, as_stage
from dockrl.dock.transport import BadMessage, Lost, NoReply, SocketTransport
from dockrl.dock.warehouse import Warehouse

WAIT_SLICE_S = 2.0  # a waiting get re-asks at least this often (liveness of the store is checked by the call)


class CentralDock:
    """Controller and warehouse in one object: a SharedController (thread-safe, long-polling `wait_poll`)
    and a Warehouse that notifies it directly.

    Args:
        policy, max_rows: as for DockController.
    """

    def __init__(self, *, policy: str = "first", max_rows: int | None = None) -> None:
        self.controller = SharedController(1, policy=policy, max_rows=max_rows)
        self.warehouse = Warehouse(0, self.controller)
        self._lock = threading.Lock()  # add_groups and reset are two-part

    def add_groups(self, group_sizes: list[int], prompt_lens: list[int], batch: dict[str, list]) -> list[int]:
        """Add groups and store their per-row batch (prompt_ids, label, ...) in one call."""
        with self._lock:
            rows = self.controller.add_groups(group_sizes, prompt_lens)
            self.warehouse.put(rows, batch)
        return rows

    def put(self, rows: list[int], batch: dict[str, list]) -> int:
        """Store cells and mark them ready; returns bytes stored."""
        return self.warehouse.put(rows, batch)

    def poll_get(
        self, consumer: str, columns: list[str], count: int, wait_s: float = 0.0, **options
    ) -> tuple:
        """Allocate and fetch in one call: (rows, batch), or (None, done) like DockController.poll; waits up
        to `wait_s` for the request to become servable (SharedController.wait_poll)."""
        allocation, done = self.controller.wait_poll(consumer, columns, count, wait_s, **options)
        if allocation is None:
            return None, done
        return allocation.rows, self.warehouse.get(allocation.rows, columns)

    def peek_get(self, columns: list[str]) -> tuple[list[int], dict[str, list]]:
        """DockController.peek and the rows' values in one call; consumes nothing."""
        rows = self.controller.peek(columns).rows
        return rows, self.warehouse.get(rows, columns) if rows else {column: [] for column in columns}

    def serve(self, host: str | None = None) -> tuple[tuple, bytes]:
        """Start (once) a socket hub for this store in this process (single mode's socket transport; host None:
        this Ray node's address); returns (address, authkey)."""
        from dockrl.dock.transport import ServiceHub

        if getattr(self, "_hub", None) is None:
            self._hub = ServiceHub(self, host)
        return self._hub.address, self._hub.authkey

    def ask(self, method: str, *args) -> Any:
        """A controller method (all_consumed, unready_rows, ...)."""
        return getattr(self.controller, method)(*args)

    def stats(self) -> dict:
        """Controller stats plus "warehouses": [the warehouse's stats]."""
        stats = self.controller.stats()
        stats["warehouses"] = [self.warehouse.stats()]
        return stats

    def reset(self, keep_unfinished: str | None = None, served_by: str | None = None) -> list[int]:
        """Controller reset and warehouse clear, keeping unfinished rows if asked."""
        with self._lock:
            kept = self.controller.reset(keep_unfinished, served_by)
            self.warehouse.clear(kept)
        return kept


class HubTransport:
    """Calls a CentralDock served by a ServiceHub: in the driver (driver mode) or in the replay-buffer actor
    (single mode with the socket transport); `owner` names it in errors."""

    def __init__(
        self, address: tuple, authkey: bytes, timeout_s: float = 300.0, owner: str = "the driver's dock hub"
    ) -> None:
        self.socket, self.timeout_s, self.owner = SocketTransport(address, authkey), timeout_s, owner

    def request(self, method: str, *args, extra_wait_s: float = 0.0, **kwargs) -> Any:
        """Run `store.method(*args, **kwargs)` where the store lives; re-raise its errors here.
        extra_wait_s: how long the method itself may wait (a long poll), on top of the reply timeout."""
        timeout_s = self.timeout_s + extra_wait_s
        try:
            return self.socket.call(method, *args, timeout_s=timeout_s, **kwargs)
        except BadMessage as error:
            raise DockError(f"{self.owner}'s reply to {method} could not be unpickled: {error}") from error
        except Lost as error:
            raise WarehouseDiedError(
                f"{self.owner} at {self.socket.address} is gone during {method} (it holds every row of the "
                f"step); restart the run. Cause: {error}"
            ) from error
        except NoReply as error:
            raise DockTimeoutError(f"{self.owner} did not answer {method} within {timeout_s:g}s") from error


class ActorTransport:
    """Calls a CentralDock Ray actor (single mode), with a timeout and a named error if it died."""

    def __init__(self, actor: Any, timeout_s: float) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    def request(self, method: str, *args, extra_wait_s: float = 0.0, **kwargs) -> Any:
        """ray.get(actor.method.remote(...)) with errors that name the replay-buffer actor; extra_wait_s as
        for HubTransport.request."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ref = getattr(self.actor, method).remote(*args, **kwargs)
            return ray.get(ref, timeout=self.timeout_s + extra_wait_s)
        except RayActorError as error:
            raise WarehouseDiedError(
                f"the dock's single replay-buffer actor died during {method}; every row of the step is "
                f"lost. Restart the run. Cause: {error}"
            ) from error
        except GetTimeoutError as error:
            raise DockTimeoutError(
                f"the dock's replay-buffer actor did not answer {method} within {self.timeout_s:g}s"
            ) from error


class CentralClient(ClientCounters, DockAPI):
    """The DockAPI (api.py) over a CentralDock (single or driver mode)."""

    def __init__(
        self, transport: HubTransport | ActorTransport, mode: str, *, get_timeout_s: float = 300.0
    ) -> None:
        self.transport, self.mode = transport, mode
        self.get_timeout_s = get_timeout_s
        self._reset_counters()

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """As DockClient.add_groups (one store, so no round-robin)."""
        check_put(Stage.DRIVER, [PROMPT_IDS, LABEL, *(extra or {})], "add_groups")
        per_prompt = {PROMPT_IDS: prompts, LABEL: labels, **(extra or {})}
        for name, values in per_prompt.items():
            if len(values) != len(prompts):
                raise ValueError(f"add_groups: {name} has {len(values)} values for {len(prompts)} prompts")
        if not prompts:
            return []
        batch = defaultdict(list)
        for column, values in per_prompt.items():
            for value in values:
                batch[column].extend([value] * group_size)
        self.bytes_put += batch_nbytes(batch)
        return self.transport.request(
            "add_groups", [group_size] * len(prompts), [len(p) for p in prompts], seal_batch(batch)
        )

    def put(self, producer: Stage, rows: list[int], batch: dict[str, list]) -> None:
        """As DockClient.put."""
        check_put(producer, batch)
        t0 = time.perf_counter()
        self.transport.request("put", rows, seal_batch(batch))
        self.bytes_put += batch_nbytes(batch)
        self.latency.record("put", time.perf_counter() - t0)

    def pull(self, request: Pull) -> tuple[list[int], dict[str, list]] | None:
        """As DockClient.pull."""
        columns, count = request.columns, request.count
        name = check_get(request.consumer, columns).value  # the store keys its bitmaps by the plain name
        timeout_s = self.get_timeout_s if request.timeout_s is None else request.timeout_s
        start = time.monotonic()
        given: dict[str, Any] = dict(
            whole_groups=request.whole_groups,
            min_count=request.min_count,
            balance_over=request.balance_over,
            policy=request.policy,
            peer=request.peer,
        )
        options = {k: v for k, v in given.items() if v is not None}
        while True:
            wait_s = max(0.0, min(WAIT_SLICE_S, start + timeout_s - time.monotonic()))
            rows, value = self.transport.request(
                "poll_get", name, columns, count, wait_s, extra_wait_s=wait_s, **options
            )
            if rows is not None:
                self.bytes_got += batch_nbytes(value)
                self.latency.record("get", time.monotonic() - start)
                return rows, unseal_batch(value)
            if value:
                return None
            if time.monotonic() - start >= timeout_s:
                waiting = self.transport.request("ask", "unready_rows", columns)
                raise DockTimeoutError(
                    f"dock get timed out after {timeout_s:g}s ({self.mode} mode): name {name!r} "
                    f"asked for {count} rows of columns {list(columns)}; rows not ready: {waiting}. Is "
                    "the producer of the missing columns running? (raise dock.get_timeout_s if slow)"
                )

    def peek(self, columns: list[str]) -> tuple[list[int], dict[str, list]]:
        """As DockClient.peek."""
        check_columns(columns, "peek")
        rows, batch = self.transport.request("peek_get", columns)
        self.bytes_got += batch_nbytes(batch)
        return rows, unseal_batch(batch)

    def drop(self, rows: list[int]) -> int:
        """As DockClient.drop."""
        return self.transport.request("ask", "drop", rows)

    def all_consumed(self, consumer: Stage) -> bool:
        """As DockClient.all_consumed."""
        return self.transport.request(
            "ask", "all_consumed", as_stage(consumer, "all_consumed: consumer").value
        )

    def ages(self) -> list[int]:
        """As DockClient.ages."""
        return self.transport.request("ask", "ages")

    def stats(self) -> dict:
        """As DockClient.stats; "mode" is single or driver."""
        stats = self.transport.request("stats")
        stats["mode"] = self.mode
        stats["client"] = self.client_stats()
        return stats

    def reset(self, keep_unfinished: str | None = None, served_by: Stage | None = None) -> list[int]:
        """As DockClient.reset."""
        served = None if served_by is None else as_stage(served_by, "reset: served_by").value
        kept = self.transport.request("reset", keep_unfinished, served)
        self.bytes_put = self.bytes_got = 0
        return kept

    def check_warehouses(self) -> None:
        """Raise if the store is gone (a cheap call)."""
        self.transport.request("ask", "num_rows")


__all__ = ["ActorTransport", "CentralClient", "CentralDock", "DockError", "HubTransport"]
