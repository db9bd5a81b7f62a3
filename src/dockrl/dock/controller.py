"""Dock controller: the metadata half of the transfer dock (no payload, no Ray).

```
             metadata only (this class)                      payload (warehouse.py)
 driver --add_groups--> DockController <--mark_ready(w, rows, cols)-- Warehouse[w] <--put-- producer client
                          |    ^                                          |
                          |    +--allocate(consumer, cols, n)-- consumer client --get(rows by warehouse)-->+
                          +--> Allocation(rows, locations per column)      (pulls payload directly, in parallel)
```

The controller knows which rows exist, how they group, their lengths, which (row, column) cells are ready and
on which warehouse, and which rows each consumer has already taken. Warehouses call `mark_ready` after storing
a put; clients call `allocate` and then fetch the payload straight from the warehouses named in the
`Allocation`. The controller never calls anyone, so warehouses may block on it without deadlock.

Lifecycle of one training step's table:
  reset() -> add_groups(...) (driver, may be repeated) -> mark_ready(...) as producers put columns ->
  allocate(...) by each consumer until all_consumed(consumer) -> reset() for the next step.
Row ids start at 0 after every reset and are contiguous within a group.

The state is kept in flat numpy arrays (one entry per row) so that `allocate` costs a few vector operations
even for tables of 10^5 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROMPT_LEN = "prompt_len"
RESPONSE_LEN = "response_len"


@dataclass
class Allocation:
    """Rows handed to one consumer and where their payload lives.

    rows: served row ids, ascending.
    locations: per requested column, the warehouse index holding each row's cell (same order as `rows`).
    """

    rows: list[int]
    locations: dict[str, list[int]]


class DockController:
    """Metadata only: rows, groups, lengths, ready bitmap per column, consumed bitmap per consumer, and the
    warehouse index holding each (row, column) cell.

    Args:
        num_warehouses: how many warehouses may call `mark_ready` (indices 0..num_warehouses-1).
    """

    def __init__(self, num_warehouses: int) -> None:
        if num_warehouses < 1:
            raise ValueError(f"num_warehouses={num_warehouses} must be >= 1")
        self.num_warehouses = num_warehouses
        self.reset()

    # ---------------------------------------------------------------- lifecycle

    def reset(self) -> None:
        """Forget every row, group, column and consumer; the next row id is 0 again.

        Call it between steps, when no producer or consumer is still working on the old table.
        """
        self._num_rows = 0
        self._capacity = 0
        self._group_starts: list[int] = []
        self._group_sizes: list[int] = []
        self._row_group = np.zeros(0, dtype=np.int64)
        self._lengths: dict[str, np.ndarray] = {}  # name -> int64 [capacity], -1 = unknown
        self._ready: dict[str, np.ndarray] = {}  # column -> bool [capacity]
        self._location: dict[str, np.ndarray] = {}  # column -> int32 [capacity], -1 = nowhere
        self._consumed: dict[str, np.ndarray] = {}  # consumer -> bool [capacity]

    def add_groups(self, group_sizes: list[int], prompt_lens: list[int]) -> list[int]:
        """Allocate rows for new groups (one group per prompt) and return ALL their row ids, in order.

        Group i gets `group_sizes[i]` contiguous row ids, each with prompt_len `prompt_lens[i]`.
        No column is ready yet: the caller puts prompt_ids/label to a warehouse afterwards.
        """
        if len(group_sizes) != len(prompt_lens):
            raise ValueError(
                f"add_groups got {len(group_sizes)} group_sizes but {len(prompt_lens)} prompt_lens; "
                "pass one prompt length per group"
            )
        if any(size < 1 for size in group_sizes):
            raise ValueError(f"group sizes must be >= 1, got {group_sizes}")
        first = self._num_rows
        total = sum(group_sizes)
        self._grow(first + total)
        row = first
        for group_size, prompt_len in zip(group_sizes, prompt_lens):
            group = len(self._group_starts)
            self._group_starts.append(row)
            self._group_sizes.append(group_size)
            self._row_group[row : row + group_size] = group
            self._lengths[PROMPT_LEN][row : row + group_size] = prompt_len
            row += group_size
        self._num_rows = first + total
        return list(range(first, first + total))

    def _grow(self, needed: int) -> None:
        """Make every per-row array hold at least `needed` rows (capacity doubles, amortised O(1))."""
        if needed <= self._capacity:
            return
        capacity = max(needed, 2 * self._capacity, 64)

        def grown(old: np.ndarray, fill) -> np.ndarray:
            array = np.full(capacity, fill, dtype=old.dtype)
            array[: self._capacity] = old[: self._capacity]
            return array

        self._row_group = grown(self._row_group, -1)
        self._lengths.setdefault(PROMPT_LEN, np.zeros(0, dtype=np.int64))
        self._lengths = {name: grown(a, -1) for name, a in self._lengths.items()}
        self._ready = {col: grown(a, False) for col, a in self._ready.items()}
        self._location = {col: grown(a, -1) for col, a in self._location.items()}
        self._consumed = {name: grown(a, False) for name, a in self._consumed.items()}
        self._capacity = capacity

    # ---------------------------------------------------------------- producers

    def mark_ready(
        self,
        warehouse: int,
        rows: list[int],
        columns: list[str],
        lengths: dict[str, list[int]] | None = None,
    ) -> None:
        """Record that `warehouse` now holds `columns` for `rows` (called by the warehouse after storing).

        `lengths` (e.g. {"response_len": [...]}, one value per row) update the per-row length metadata.
        A cell put again moves to the newest warehouse.
        """
        if not 0 <= warehouse < self.num_warehouses:
            raise ValueError(f"warehouse={warehouse} is not in [0, {self.num_warehouses})")
        index = self._row_index(rows)
        for column in columns:
            if column not in self._ready:
                self._ready[column] = np.zeros(self._capacity, dtype=bool)
                self._location[column] = np.full(self._capacity, -1, dtype=np.int32)
            self._ready[column][index] = True
            self._location[column][index] = warehouse
        for name, values in (lengths or {}).items():
            if len(values) != len(rows):
                raise ValueError(f"lengths[{name!r}] has {len(values)} values for {len(rows)} rows")
            if name not in self._lengths:
                self._lengths[name] = np.full(self._capacity, -1, dtype=np.int64)
            self._lengths[name][index] = values

    def _row_index(self, rows: list[int]) -> np.ndarray:
        index = np.asarray(rows, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= self._num_rows):
            bad = [r for r in rows if not 0 <= r < self._num_rows][:8]
            raise ValueError(
                f"rows {bad} do not exist (the table has {self._num_rows} rows); "
                "rows come from add_groups and are forgotten by reset"
            )
        return index

    # ---------------------------------------------------------------- consumers

    def allocate(
        self,
        consumer: str,
        columns: list[str],
        count: int,
        *,
        whole_groups: bool = False,
        min_count: int | None = None,
    ) -> Allocation | None:
        """Serve up to `count` rows whose `columns` are all ready and that `consumer` has not taken yet.

        Served rows are marked consumed by `consumer` in the same call (exactly once per consumer; other
        consumers are independent). Lowest row ids first. Returns None when nothing can be served now.

        min_count (default `count`): serve only if at least this many rows can be served. Tail rule: when
        fewer than `min_count` rows are left unconsumed in the whole table, the remainder is served as soon
        as it is all ready. The tail rule trusts that the driver has added every group of the step.

        whole_groups: serve only groups whose rows are ALL ready (an incomplete group is never served); a
        group is never split across allocations. `count` and `min_count` stay in rows. When all groups have
        the same size g, both must be multiples of g (checked). With unequal sizes, `count` must be at least
        the largest group; groups are packed first-fit in row order, and a batch that no further group could
        fit (more than count - largest_group rows) counts as full even if below `min_count`.
        """
        min_count = count if min_count is None else min_count
        self._check_request(columns, count, min_count, whole_groups)
        n = self._num_rows
        consumed = self._consumed_of(consumer)[:n]
        remaining = n - int(consumed.sum())
        if remaining == 0 or any(col not in self._ready for col in columns):
            return None
        ready = np.logical_and.reduce([self._ready[col][:n] for col in columns])
        need = min(min_count, remaining)
        if whole_groups:
            need = min(need, count - max(self._group_sizes) + 1)
            rows = self._pick_groups(ready, consumed, count)
        else:
            rows = np.flatnonzero(ready & ~consumed)[:count]
        if rows.size == 0 or rows.size < need:
            return None
        consumed[rows] = True
        return Allocation(
            rows=rows.tolist(),
            locations={col: self._location[col][rows].tolist() for col in columns},
        )

    def _check_request(self, columns: list[str], count: int, min_count: int, whole_groups: bool) -> None:
        if isinstance(columns, str) or not columns:
            raise ValueError(f"columns={columns!r} must be a non-empty list of column names")
        if count < 1 or not 1 <= min_count <= count:
            raise ValueError(f"need 1 <= min_count <= count, got count={count} min_count={min_count}")
        if not whole_groups or not self._group_sizes:
            return
        smallest, largest = min(self._group_sizes), max(self._group_sizes)
        if count < largest:
            raise ValueError(f"whole_groups with count={count} can never serve a group of {largest} rows")
        if smallest == largest and (count % largest or min_count % largest):
            raise ValueError(
                f"whole_groups: count={count} and min_count={min_count} must be multiples of the group "
                f"size {largest}"
            )

    def _consumed_of(self, consumer: str) -> np.ndarray:
        if consumer not in self._consumed:
            self._consumed[consumer] = np.zeros(self._capacity, dtype=bool)
        return self._consumed[consumer]

    def _pick_groups(self, ready: np.ndarray, consumed: np.ndarray, count: int) -> np.ndarray:
        """First-fit whole groups (all rows ready, some unconsumed) in row order, up to `count` rows."""
        starts = np.asarray(self._group_starts, dtype=np.int64)
        sizes = np.asarray(self._group_sizes, dtype=np.int64)
        num_ready = np.add.reduceat(ready.astype(np.int64), starts)
        num_unconsumed = np.add.reduceat((~consumed).astype(np.int64), starts)
        picked: list[np.ndarray] = []
        total = 0
        for group in np.flatnonzero((num_ready == sizes) & (num_unconsumed > 0)):
            if total + num_unconsumed[group] > count:
                continue
            start = starts[group]
            # Normally the whole group; fewer only if this consumer also took single rows of it.
            group_rows = start + np.flatnonzero(~consumed[start : start + sizes[group]])
            picked.append(group_rows)
            total += group_rows.size
            if total == count:
                break
        return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)

    def poll(
        self,
        consumer: str,
        columns: list[str],
        count: int,
        *,
        whole_groups: bool = False,
        min_count: int | None = None,
    ) -> tuple[Allocation | None, bool]:
        """`allocate`, plus whether `consumer` has consumed every row: one round trip for a polling client.

        Returns (allocation, False) when served, (None, True) when nothing more will ever come, and
        (None, False) when the caller should wait and retry.
        """
        allocation = self.allocate(consumer, columns, count, whole_groups=whole_groups, min_count=min_count)
        if allocation is not None:
            return allocation, False
        return None, self.all_consumed(consumer)

    def all_consumed(self, consumer: str) -> bool:
        """True iff the table has rows and `consumer` has taken every one.

        An empty table is not "all consumed", so a worker loop started before the driver adds prompts waits
        instead of exiting.
        """
        n = self._num_rows
        return n > 0 and bool(self._consumed_of(consumer)[:n].all())

    # ---------------------------------------------------------------- introspection

    def num_rows(self) -> int:
        """Number of rows added since the last reset."""
        return self._num_rows

    def group_sizes(self) -> list[int]:
        """Size of every group, in row order."""
        return list(self._group_sizes)

    def ready_counts(self, columns: list[str]) -> dict[str, int]:
        """Number of rows whose cell is ready, per column (0 for a column never put)."""
        n = self._num_rows
        return {col: int(self._ready[col][:n].sum()) if col in self._ready else 0 for col in columns}

    def consumed_count(self, consumer: str) -> int:
        """Number of rows `consumer` has taken."""
        return int(self._consumed[consumer][: self._num_rows].sum()) if consumer in self._consumed else 0

    def lengths(self, rows: list[int], names: list[str] | None = None) -> dict[str, list[int]]:
        """Per-row length metadata (prompt_len, response_len, ...); -1 where not known yet."""
        index = self._row_index(rows)
        names = list(self._lengths) if names is None else names
        return {name: self._lengths[name][index].tolist() for name in names if name in self._lengths}

    def locations(self, rows: list[int], columns: list[str]) -> dict[str, list[int]]:
        """Warehouse index holding each (row, column) cell; -1 where the cell is not ready."""
        index = self._row_index(rows)
        return {
            col: self._location[col][index].tolist() if col in self._location else [-1] * len(rows)
            for col in columns
        }

    def stats(self) -> dict:
        """Counts for logs and error messages.

        Keys: num_rows, num_groups, ready (column -> rows ready), consumed (consumer -> rows taken),
        warehouse_cells (per warehouse, the number of ready (row, column) cells it holds).
        """
        n = self._num_rows
        cells = np.zeros(self.num_warehouses, dtype=np.int64)
        for location in self._location.values():
            held = location[:n]
            cells += np.bincount(held[held >= 0], minlength=self.num_warehouses)
        return {
            "num_rows": n,
            "num_groups": len(self._group_sizes),
            "ready": self.ready_counts(list(self._ready)),
            "consumed": {name: self.consumed_count(name) for name in self._consumed},
            "warehouse_cells": cells.tolist(),
        }
