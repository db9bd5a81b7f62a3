"""SharedController: the DockController behind a lock, for many threads (the controller actor's class).

Every public method runs under one re-entrant lock, so `allocate` stays atomic whichever thread (a Ray actor
thread or a socket hub thread) calls it. `wait_poll` is a long poll with push-based readiness: a consumer that
cannot be served yet parks a waiter; each change of the table (mark_ready of some columns, add_groups, reset)
tries to serve the parked waiters that the change concerns, under the lock, and wakes only those it served
(or that are done). No thundering herd of threads re-polling after every put, no sleep-and-retry latency.
No Ray import.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

from dockrl.dock.controller import Allocation, DockController
from dockrl.dock.transport import ServiceHub

_READING = (
    "allocate",
    "peek",
    "poll",
    "all_consumed",
    "num_rows",
    "group_sizes",
    "ages",
    "ready_counts",
    "consumed_count",
    "lengths",
    "locations",
    "unready_rows",
    "rows_on",
    "stats",
)


@dataclass(eq=False)
class _Waiter:
    consumer: str
    columns: list[str]
    count: int
    options: dict
    event: threading.Event = field(default_factory=threading.Event)
    result: tuple | None = None  # (allocation, done) once answered
    error: Exception | None = None


class SharedController(DockController):
    """DockController whose methods are thread-safe, plus `wait_poll` and `serve` (see module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        self._lock = threading.RLock()  # poll calls allocate under it
        self._waiters: list[_Waiter] = []
        super().__init__(*args, **kwargs)
        self._hub: ServiceHub | None = None

    def wait_poll(
        self, consumer: str, columns: list[str], count: int, wait_s: float, **options
    ) -> tuple[Allocation | None, bool]:
        """`poll`, waiting up to `wait_s` for the table to change until it serves or says done.

        Returns like `poll`; (None, False) after `wait_s` without an allocation (the client then checks the
        warehouses' health and asks again). An allocation made for a waiter is always delivered.
        """
        with self._lock:
            allocation, done = DockController.poll(self, consumer, columns, count, **options)
            if allocation is not None:
                self._serve_waiters(consumers={consumer})  # planned bins for this consumer's peers
            if allocation is not None or done or wait_s <= 0:
                return allocation, done
            waiter = _Waiter(consumer, list(columns), count, options)
            self._waiters.append(waiter)
        waiter.event.wait(wait_s)
        with self._lock:
            if waiter.result is None and waiter.error is None:  # timed out, nothing was allocated for it
                self._waiters.remove(waiter)
                return None, False
        if waiter.error is not None:
            raise waiter.error
        return waiter.result  # type: ignore[return-value]  # set with the served allocation

    def _serve_waiters(
        self,
        columns: set[str] | None = None,
        consumers: set[str] | None = None,
        warehouse: int | None = None,
    ) -> None:
        """Answer the parked waiters a change may concern (all when both filters are None); under the lock.

        columns: columns that became ready; consumers: consumers whose own state changed (an allocation
        planned bins for peers, or consumed their last rows). warehouse: where the ready cells are; waiters on
        its node are served first, so rows go to a consumer beside them when one is waiting.
        """
        while self._waiters:
            touched: set[str] = set()
            waiters = list(self._waiters)
            if warehouse is not None:
                waiters.sort(key=lambda w: warehouse not in (w.options.get("near") or ()))
            for waiter in waiters:
                concerned = (columns is None and consumers is None) or (
                    (columns is not None and not columns.isdisjoint(waiter.columns))
                    or (consumers is not None and waiter.consumer in consumers)
                )
                if not concerned:
                    continue
                try:
                    allocation, done = DockController.poll(
                        self, waiter.consumer, waiter.columns, waiter.count, **waiter.options
                    )
                except Exception as error:  # noqa: BLE001 - delivered to the waiting caller
                    waiter.error = error
                else:
                    if allocation is None and not done:
                        continue
                    waiter.result = (allocation, done)
                    if allocation is not None:
                        touched.add(waiter.consumer)
                self._waiters.remove(waiter)
                waiter.event.set()
            if not touched:
                return
            columns, consumers = set(), touched  # serving a consumer may plan bins for its other waiters

    def add_groups(self, *args, **kwargs) -> list[int]:
        with self._lock:
            rows = DockController.add_groups(self, *args, **kwargs)
            self._serve_waiters()
            return rows

    def mark_ready(self, warehouse, rows, columns, lengths=None) -> None:
        with self._lock:
            DockController.mark_ready(self, warehouse, rows, columns, lengths)
            self._serve_waiters(columns=set(columns), warehouse=warehouse)

    def drop(self, rows: list[int]) -> int:
        with self._lock:
            dropped = DockController.drop(self, rows)
            self._serve_waiters()  # a consumer may have nothing left to wait for
            return dropped

    def reset(self, *args, **kwargs) -> list[int]:
        with self._lock:
            kept = DockController.reset(self, *args, **kwargs)
            self._serve_waiters()
            return kept

    def serve(self, host: str | None = None) -> tuple[tuple, bytes]:
        """Start (once) a socket hub for this controller in this process (host None: this Ray node's
        address); returns (address, authkey)."""
        if self._hub is None:
            self._hub = ServiceHub(self, host)
        return self._hub.address, self._hub.authkey


def _locked(name: str):
    method = getattr(DockController, name)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


for _name in _READING:
    setattr(SharedController, _name, _locked(_name))
