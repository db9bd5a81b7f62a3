"""Comparison modes of the dock: data and metadata in ONE place, behind the same client interface.

```
 single:  worker --put/get--> [ReplayBuffer actor: controller + one warehouse] <--put/get-- worker
 driver:  worker --put/get--> [driver process: controller + one warehouse, socket hub] <-- worker
          (the single-controller design: every byte of payload passes through the driver)
```

`CentralDock` is the store (a DockController and a Warehouse in one object, one lock). In `single` mode it
is a Ray actor; in `driver` mode it lives in the driver process and a `DriverHub` thread serves it to
workers over authenticated multiprocessing connections. `CentralClient` offers DockClient's methods
(add_groups, put, get, all_consumed, stats, reset) over either transport, so recipes and benchmarks do not
care which mode runs. Used for benchmarks and as a fallback; `dock` mode is the scalable one.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import defaultdict
from multiprocessing.connection import Client, Listener
from typing import Any

from dockrl.dock.controller import DockController
from dockrl.dock.errors import DockError, DockTimeoutError, WarehouseDiedError
from dockrl.dock.metrics import ClientCounters, batch_nbytes
from dockrl.dock.warehouse import Warehouse

MAX_POLL_INTERVAL_S = 0.1


class CentralDock:
    """Controller and warehouse in one object; every method is atomic under one lock.

    Args:
        policy, max_rows: as for DockController.
    """

    def __init__(self, *, policy: str = "first", max_rows: int | None = None) -> None:
        self.controller = DockController(1, policy=policy, max_rows=max_rows)
        self.warehouse = Warehouse(0, self.controller)
        self._lock = threading.Lock()

    def add_groups(self, group_sizes: list[int], prompt_lens: list[int], batch: dict[str, list]) -> list[int]:
        """Add groups and store their per-row batch (prompt_ids, label, ...) in one call."""
        with self._lock:
            rows = self.controller.add_groups(group_sizes, prompt_lens)
            self.warehouse.put(rows, batch)
        return rows

    def put(self, rows: list[int], batch: dict[str, list]) -> int:
        """Store cells and mark them ready; returns bytes stored."""
        with self._lock:
            return self.warehouse.put(rows, batch)

    def poll_get(self, consumer: str, columns: list[str], count: int, **options) -> tuple:
        """Allocate and fetch in one call: (rows, batch), or (None, done) like DockController.poll."""
        with self._lock:
            allocation, done = self.controller.poll(consumer, columns, count, **options)
            if allocation is None:
                return None, done
            return allocation.rows, self.warehouse.get(allocation.rows, columns)

    def call(self, method: str, *args) -> Any:
        """A controller method (all_consumed, unready_rows, ...), under the lock."""
        with self._lock:
            return getattr(self.controller, method)(*args)

    def stats(self) -> dict:
        """Controller stats plus "warehouses": [the warehouse's stats]."""
        with self._lock:
            stats = self.controller.stats()
            stats["warehouses"] = [self.warehouse.stats()]
        return stats

    def reset(self, keep_unfinished: str | None = None) -> list[int]:
        """Controller reset and warehouse clear, keeping unfinished rows if asked."""
        with self._lock:
            kept = self.controller.reset(keep_unfinished)
            self.warehouse.clear(kept)
        return kept


class DriverHub:
    """Serves a CentralDock living in this (the driver's) process to clients in other processes.

    One thread accepts connections; one thread per connection answers (method, args, kwargs) messages.
    """

    _local: dict[tuple, CentralDock] = {}  # address -> store served in this process (clients skip the socket)

    def __init__(self, store: CentralDock, host: str = "127.0.0.1") -> None:
        self.store = store
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener((host, 0), backlog=128, authkey=self.authkey)
        self.address = self._listener.address
        DriverHub._local[self.address] = store
        self._closed = False
        threading.Thread(target=self._accept, name="dock-driver-hub", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection = self._listener.accept()
            except Exception:  # noqa: BLE001 - a failed handshake must not stop the hub
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection) -> None:
        with connection:
            while True:
                try:
                    method, args, kwargs = connection.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", getattr(self.store, method)(*args, **kwargs))
                except Exception as error:  # noqa: BLE001 - sent back and re-raised in the client
                    reply = ("error", error)
                connection.send(reply)

    def close(self) -> None:
        """Stop accepting connections (open ones end when their clients go away)."""
        self._closed = True
        DriverHub._local.pop(self.address, None)
        self._listener.close()


class HubTransport:
    """Calls a CentralDock through a DriverHub (directly when the hub runs in this process)."""

    def __init__(self, address: tuple, authkey: bytes) -> None:
        self.address, self.authkey = address, authkey
        self._connections = threading.local()

    def __getstate__(self) -> dict:
        return {"address": self.address, "authkey": self.authkey}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"], state["authkey"])

    def call(self, method: str, *args, **kwargs) -> Any:
        """Run `store.method(*args, **kwargs)` where the store lives; re-raise its errors here."""
        local = DriverHub._local.get(self.address)
        if local is not None:
            return getattr(local, method)(*args, **kwargs)
        connection = getattr(self._connections, "connection", None)
        try:
            if connection is None:
                connection = self._connections.connection = Client(self.address, authkey=self.authkey)
            connection.send((method, args, kwargs))
            status, value = connection.recv()
        except (OSError, EOFError) as error:
            self._connections.connection = None
            raise WarehouseDiedError(
                f"the driver's dock hub at {self.address} is gone during {method} (driver mode: the driver "
                f"holds every row); restart the run. Cause: {error!r}"
            ) from error
        if status == "error":
            raise value
        return value


class ActorTransport:
    """Calls a CentralDock Ray actor (single mode), with a timeout and a named error if it died."""

    def __init__(self, actor: Any, timeout_s: float) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    def call(self, method: str, *args, **kwargs) -> Any:
        """ray.get(actor.method.remote(...)) with errors that name the replay-buffer actor."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs), timeout=self.timeout_s)
        except RayActorError as error:
            raise WarehouseDiedError(
                f"the dock's single replay-buffer actor died during {method}; every row of the step is "
                f"lost. Restart the run. Cause: {error}"
            ) from error
        except GetTimeoutError as error:
            raise DockTimeoutError(
                f"the dock's replay-buffer actor did not answer {method} within {self.timeout_s:g}s"
            ) from error


class CentralClient(ClientCounters):
    """DockClient's interface over a CentralDock (single or driver mode)."""

    def __init__(
        self, transport: Any, mode: str, *, get_timeout_s: float = 300.0, poll_interval_s: float = 0.01
    ):
        self.transport, self.mode = transport, mode
        self.get_timeout_s, self.poll_interval_s = get_timeout_s, poll_interval_s
        self._reset_counters()

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """As DockClient.add_groups (one store, so no round-robin)."""
        per_prompt = {"prompt_ids": prompts, "label": labels, **(extra or {})}
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
        return self.transport.call(
            "add_groups", [group_size] * len(prompts), [len(p) for p in prompts], dict(batch)
        )

    def put(self, rows: list[int], batch: dict[str, list]) -> None:
        """As DockClient.put."""
        t0 = time.perf_counter()
        self.transport.call("put", rows, batch)
        self.bytes_put += batch_nbytes(batch)
        self.latency.record("put", time.perf_counter() - t0)

    def get(
        self, consumer: str, columns: list[str], count: int, *, timeout_s: float | None = None, **options
    ) -> tuple[list[int], dict[str, list]] | None:
        """As DockClient.get (options: whole_groups, min_count, balance_over, policy)."""
        timeout_s = self.get_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        delay = self.poll_interval_s
        options = {k: v for k, v in options.items() if v is not None}
        while True:
            rows, value = self.transport.call("poll_get", consumer, columns, count, **options)
            if rows is not None:
                self.bytes_got += batch_nbytes(value)
                self.latency.record("get", time.monotonic() - start)
                return rows, value
            if value:
                return None
            if time.monotonic() - start >= timeout_s:
                waiting = self.transport.call("call", "unready_rows", columns)
                raise DockTimeoutError(
                    f"dock get timed out after {timeout_s:g}s ({self.mode} mode): consumer {consumer!r} "
                    f"asked for {count} rows of columns {list(columns)}; rows not ready: {waiting}. Is "
                    "the producer of the missing columns running? (raise dock.get_timeout_s if slow)"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, MAX_POLL_INTERVAL_S)

    def all_consumed(self, consumer: str) -> bool:
        """As DockClient.all_consumed."""
        return self.transport.call("call", "all_consumed", consumer)

    def stats(self) -> dict:
        """As DockClient.stats; "mode" is single or driver."""
        stats = self.transport.call("stats")
        stats["mode"] = self.mode
        stats["client"] = self.client_stats()
        return stats

    def reset(self, keep_unfinished: str | None = None) -> list[int]:
        """As DockClient.reset."""
        kept = self.transport.call("reset", keep_unfinished)
        self.bytes_put = self.bytes_got = 0
        return kept

    def check_warehouses(self) -> None:
        """Raise if the store is gone (a cheap call)."""
        self.transport.call("call", "num_rows")


__all__ = ["ActorTransport", "CentralClient", "CentralDock", "DockError", "DriverHub", "HubTransport"]
