"""Dock warehouse: the payload half of the transfer dock (no Ray import; launch.py wraps it as an actor).

A warehouse stores column cells for the rows written to it and serves them back by (row, column). The
clients seal tensors and arrays before they send them (cells.py), so a warehouse holds bytes it never decodes
and never imports torch: four warehouses importing torch beside a step cost the dock its multi-node gain once
(2026-12-04, issue 46: 143 -> 45 rows/s on 4 emulated nodes). In dock
mode the client tells the controller about a put itself, in parallel with sending the payload here (one
round trip instead of two in a row); a consumer served those rows may then ask for cells still in flight,
so `get_cells` waits up to `in_flight_s` for them. In the central modes the warehouse is given the
controller and notifies it after storing (same process, no round trip).

Lifecycle: put/get during a step, clear(kept) between steps with the row list the controller's reset()
returned (kept rows are renumbered to their index in it, every other cell is dropped).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Protocol

from dockrl.dock.columns import LENGTH_OF
from dockrl.dock.errors import DockError
from dockrl.dock.metrics import OpLatency, payload_nbytes

# Tensor columns whose per-row length the controller keeps as metadata (column -> length name).
LENGTH_COLUMNS = LENGTH_OF  # column -> the per-row length the controller keeps of it


def lengths_of(batch: dict[str, list]) -> dict[str, list[int]]:
    """Per-row length metadata of a put (prompt_len / response_len) for the columns that carry it."""
    return {LENGTH_COLUMNS[c]: [len(v) for v in values] for c, values in batch.items() if c in LENGTH_COLUMNS}


def check_batch(rows: list[int], batch: dict[str, list], where: str) -> None:
    """One value per row in every column, or a ValueError naming the column."""
    for column, values in batch.items():
        if len(values) != len(rows):
            raise ValueError(
                f"put to {where}: column {column!r} has {len(values)} values for {len(rows)} rows; "
                "pass one value per row"
            )


class ReadyListener(Protocol):
    """What a warehouse notifies in the central modes and in unit tests: the controller itself."""

    def mark_ready(
        self, warehouse: int, rows: list[int], columns: list[str], lengths: dict[str, list[int]] | None = None
    ) -> None: ...


class Warehouse:
    """Holds column cells for the rows put to it.

    Args:
        index: this warehouse's index in the dock (reported to the controller with every put).
        controller: notified with `mark_ready(index, rows, columns, lengths)` after each put (central modes);
            None stores without notifying (dock mode: the client notifies the controller).
        in_flight_s: how long `get_cells` waits for a cell that is not stored yet (a put racing its own
            mark_ready); 0 raises at once.

    Safe to call from several threads (Ray actors with max_concurrency > 1): storage is guarded by a lock,
    and the controller is notified outside it so gets are not blocked by that round trip.
    """

    def __init__(
        self, index: int, controller: ReadyListener | None = None, *, in_flight_s: float = 0.0
    ) -> None:
        self.index = index
        self._controller = controller
        self.in_flight_s = in_flight_s
        self._lock = threading.Condition()  # notified after every put (gets wait for cells in flight)
        self._cells: dict[str, dict[int, Any]] = {}  # column -> row -> payload
        self._nbytes = 0
        self._num_puts = 0
        self._num_gets = 0
        self._cells_out = 0
        self._bytes_in = 0
        self._bytes_out = 0
        self.latency = OpLatency()
        # Changes when the actor is re-created: a client holding the old one knows its handle is stale.
        self.incarnation = uuid.uuid4().hex

    def get_incarnation(self) -> str:
        """Unique id of this warehouse instance (a restarted actor has a new one)."""
        return self.incarnation

    def serve(self, host: str | None = None) -> tuple[tuple, bytes]:
        """Start (once) a socket hub for this warehouse in this process (host None: this Ray node's
        address); returns (address, authkey)."""
        from dockrl.dock.transport import ServiceHub

        if getattr(self, "_hub", None) is None:
            self._hub = ServiceHub(self, host)
        return self._hub.address, self._hub.authkey

    def ping(self) -> int:
        """Liveness probe for clients that wait; returns the index."""
        return self.index

    def put(self, rows: list[int], batch: dict[str, list]) -> int:
        """Store `batch[column][i]` for row `rows[i]`, then notify the controller; returns bytes stored."""
        t0 = time.perf_counter()
        check_batch(rows, batch, f"warehouse {self.index}")
        nbytes = 0
        with self._lock:
            for column, values in batch.items():
                cells = self._cells.setdefault(column, {})
                for row, value in zip(rows, values):
                    old = cells.get(row)
                    if old is not None:
                        self._nbytes -= payload_nbytes(old)
                    cells[row] = value
                    nbytes += payload_nbytes(value)
            self._nbytes += nbytes
            self._bytes_in += nbytes
            self._num_puts += 1
            self._lock.notify_all()
        if self._controller is not None and rows and batch:
            self._controller.mark_ready(self.index, list(rows), list(batch), lengths_of(batch) or None)
        self.latency.record("put", time.perf_counter() - t0)
        return nbytes

    def get(self, rows: list[int], columns: list[str]) -> dict[str, list]:
        """Cells of `columns` for `rows`, in the order of `rows`."""
        return self.get_cells({column: rows for column in columns})

    def get_cells(self, rows_by_column: dict[str, list[int]]) -> dict[str, list]:
        """Cells for a different row list per column (one call serves a client's whole allocation)."""
        t0 = time.perf_counter()
        out: dict[str, list] = {}
        deadline = time.monotonic() + self.in_flight_s
        with self._lock:
            for column, rows in rows_by_column.items():
                while True:
                    cells = self._cells.get(column, {})
                    missing = [row for row in rows if row not in cells]
                    remaining = deadline - time.monotonic()
                    if not missing or remaining <= 0:
                        break
                    self._lock.wait(remaining)  # a put of these cells is in flight
                if missing:
                    raise DockError(
                        f"dock warehouse {self.index} holds no {column!r} for rows {missing[:8]} "
                        "(never put here, or cleared by a reset)"
                    )
                out[column] = [cells[row] for row in rows]
                self._cells_out += len(rows)
                self._bytes_out += sum(payload_nbytes(value) for value in out[column])
            self._num_gets += 1
        self.latency.record("get", time.perf_counter() - t0)
        return out

    def clear(self, kept: list[int] | None = None) -> None:
        """Drop every cell except those of `kept` rows, which are renumbered: row kept[i] becomes row i."""
        renumber = {old: new for new, old in enumerate(kept or [])}
        with self._lock:
            self._cells = {
                column: {renumber[row]: value for row, value in cells.items() if row in renumber}
                for column, cells in self._cells.items()
            }
            self._nbytes = sum(payload_nbytes(v) for cells in self._cells.values() for v in cells.values())
            self._bytes_in = self._bytes_out = 0  # per-step traffic figures

    def stats(self) -> dict:
        """index, rows/cells/bytes held; op counts and latency_ms (p50/p99 per op) since creation; bytes_in and
        bytes_out since the last clear (one step's traffic)."""
        with self._lock:
            rows: set[int] = set()
            for cells in self._cells.values():
                rows.update(cells)
            return {
                "index": self.index,
                "rows": len(rows),
                "cells": sum(len(cells) for cells in self._cells.values()),
                "bytes": self._nbytes,
                "num_puts": self._num_puts,
                "num_gets": self._num_gets,
                "cells_out": self._cells_out,
                "bytes_in": self._bytes_in,
                "bytes_out": self._bytes_out,
                "latency_ms": self.latency.summary(),
            }
