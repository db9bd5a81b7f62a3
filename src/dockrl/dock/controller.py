"""Dock controller: the metadata half of the transfer dock (no payload, no Ray).

```
             metadata only (this class)                      payload (warehouse.py)
 driver --add_groups--> DockController <--mark_ready(w, rows, cols)-- producer client --put--> Warehouse[w]
                          |    ^                                      (both sent at once)           |
                          |    +--allocate(consumer, cols, n)-- consumer client --get(rows by warehouse)-->+
                          +--> Allocation(rows, locations per column)      (pulls payload directly, in parallel)
```

The controller knows which rows exist, how they group, their lengths, which (row, column) cells are ready and
on which warehouse, and which rows each consumer has already taken. A producer's client calls `mark_ready`
while its payload travels to the warehouse (in the central modes the warehouse calls it after storing);
consumers' clients call `allocate` and then fetch the payload straight from the warehouses named in the
`Allocation` (a warehouse waits briefly for payload still in flight). The controller never calls anyone.
A consumer is named by its Stage's value (stages.py); the clients check it against the column schema before
they ask, so the controller keeps one bitmap per name and checks nothing about it.
SharedController (shared.py) makes it thread-safe and adds the long poll the clients use.

Lifecycle of one training step's table:
  reset() -> add_groups(...) (driver, may be repeated) -> mark_ready(...) as producers put columns ->
  allocate(...) by each consumer until all_consumed(consumer) -> reset() for the next step; `peek` reads
  ready rows without consuming them (a checkpoint's copy of a step still in flight).
Row ids start at 0 after every reset and are contiguous within a group. Partial rollout:
reset(keep_unfinished=RESPONSE_IDS) keeps every group with a row lacking that column (its other cells,
lengths and locations too), renumbers the kept rows to 0..m-1 (oldest first), adds 1 to their age and
clears every consumer's marks, so the next step's prompts are added beside them (up to max_rows); with
served_by="rollout", kept rows that have the column count as already served to that consumer (the producer
of the column does not serve a finished row again).

The state is kept in flat numpy arrays (one entry per row) so that `allocate` costs a few vector operations
even for tables of 10^5 rows.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from dockrl.dock.columns import PROMPT_LEN, RESPONSE_LEN
from dockrl.dock.errors import DockError
from dockrl.dock.locality import held_by_warehouse, local_partition, near_share
from dockrl.dock.metrics import OpLatency
from dockrl.dock.policies import LOCAL, Candidates, balanced_partition, checked_order, pack, resolve_policy


@dataclass
class Allocation:
    """Rows handed to one consumer and where their payload lives.

    rows: served row ids, ascending.
    locations: per requested column, the warehouse index holding each row's cell (same order as `rows`).
    """

    rows: list[int]
    locations: dict[str, list[int]]


class DockController:
    """Metadata only: rows, groups, lengths, ages, ready bitmap per column, consumed bitmap per consumer, and
    the warehouse index holding each (row, column) cell.

    Args:
        num_warehouses: how many warehouses may call `mark_ready` (indices 0..num_warehouses-1).
        policy: default allocation policy: "first", "oldest" or "module:function" (see policies.py).
        max_rows: capacity of the table (rows carried over + new rows); None = unbounded.
    """

    # The table, per row up to _capacity (see _clear): groups, ages, lengths, ready and consumed bitmaps.
    _num_rows: int
    _capacity: int
    _group_starts: list[int]
    _group_sizes: list[int]
    _row_group: np.ndarray
    _age: np.ndarray
    _lengths: dict[str, np.ndarray]  # name -> int64 [capacity], -1 = unknown
    _ready: dict[str, np.ndarray]  # column -> bool [capacity]
    _location: dict[str, np.ndarray]  # column -> int32 [capacity], -1 = nowhere
    _consumed: dict[str, np.ndarray]  # consumer -> bool [capacity]
    _dropped: np.ndarray  # rows taken out of the step (DAPO dynamic sampling)
    _planned: dict[str, dict[int, Allocation]]  # consumer -> balanced bins not yet handed out, by peer
    _planned_held: dict[str, dict[int, np.ndarray]]  # consumer -> per bin, its payload per warehouse

    def __init__(self, num_warehouses: int, *, policy: str = "first", max_rows: int | None = None) -> None:
        if num_warehouses < 1:
            raise ValueError(f"num_warehouses={num_warehouses} must be >= 1")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"dock.max_rows={max_rows} must be >= 1 or None (unbounded)")
        self.num_warehouses = num_warehouses
        self.max_rows = max_rows
        self._policy_name = policy
        self._policy = resolve_policy(policy)
        self.latency = OpLatency()
        # Changes when the actor is re-created: a client holding the old one knows its handle is stale.
        self.incarnation = uuid.uuid4().hex
        self._clear()

    def get_incarnation(self) -> str:
        """Unique id of this controller instance (a restarted actor has a new one)."""
        return self.incarnation

    # ---------------------------------------------------------------- lifecycle

    def reset(self, keep_unfinished: str | None = None, served_by: str | None = None) -> list[int]:
        """Start the next step's table; returns the kept old row ids in their new order (new id = index).

        keep_unfinished=None forgets every row, group, column and consumer. A column name keeps each group
        that has a row without that column ready (partial rollout), see the module docstring; `served_by`
        names the consumer that has then already taken the kept rows that have it. Call it
        between steps, when no producer or consumer is still working on the old table; the warehouses must
        then be cleared with the returned list (DockClient.reset does both).
        """
        n = self._num_rows
        if keep_unfinished is None or n == 0:
            self._clear()
            return []
        finished = self._ready.get(keep_unfinished, np.zeros(self._capacity, dtype=np.bool_))[:n]
        kept_groups = [
            g
            for g, (start, size) in enumerate(zip(self._group_starts, self._group_sizes))
            if not finished[start : start + size].all()
        ]
        kept_groups.sort(key=lambda g: -int(self._age[self._group_starts[g]]))  # oldest first, stable
        kept = [
            r
            for g in kept_groups
            for r in range(self._group_starts[g], self._group_starts[g] + self._group_sizes[g])
        ]
        if not kept:
            self._clear()
            return []
        index = np.asarray(kept, dtype=np.int64)
        old = (
            self._lengths,
            self._ready,
            self._location,
            self._age,
            [self._group_sizes[g] for g in kept_groups],
        )
        self._clear()
        self._grow(len(kept))
        lengths, ready, location, age, sizes = old
        m = len(kept)
        self._lengths = {name: self._fit(a[index]) for name, a in lengths.items()}
        self._ready = {col: self._fit(a[index]) for col, a in ready.items()}
        self._location = {col: self._fit(a[index]) for col, a in location.items()}
        self._age[:m] = age[index] + 1
        row = 0
        for size in sizes:
            self._append_group(row, size)
            row += size
        self._num_rows = m
        if served_by is not None and keep_unfinished in self._ready:
            self._consumed_of(served_by)[:m] = self._ready[keep_unfinished][:m]
        return kept

    def _clear(self) -> None:
        self._num_rows = 0
        self._capacity = 0
        self._group_starts = []
        self._group_sizes = []
        self._row_group = np.zeros(0, dtype=np.int64)
        self._age = np.zeros(0, dtype=np.int64)
        self._lengths = {}
        self._ready = {}
        self._location = {}
        self._consumed = {}
        self._dropped = np.zeros(0, dtype=np.bool_)
        self._planned = {}
        self._planned_held = {}

    def _fit(self, values: np.ndarray) -> np.ndarray:
        """`values` (one per kept row) padded to the current capacity with the array's empty value."""
        fill = False if values.dtype == bool else -1
        array = np.full(self._capacity, fill, dtype=values.dtype)
        array[: len(values)] = values
        return array

    def _append_group(self, start: int, size: int) -> None:
        self._row_group[start : start + size] = len(self._group_starts)
        self._group_starts.append(start)
        self._group_sizes.append(size)

    def add_groups(self, group_sizes: list[int], prompt_lens: list[int]) -> list[int]:
        """Allocate rows for new groups (one group per prompt) and return ALL their row ids, in order.

        Group i gets `group_sizes[i]` contiguous row ids, each with prompt_len `prompt_lens[i]` and age 0.
        No column is ready yet: the caller puts prompt_ids/label to a warehouse afterwards.
        """
        t0 = time.perf_counter()
        if len(group_sizes) != len(prompt_lens):
            raise ValueError(
                f"add_groups got {len(group_sizes)} group_sizes but {len(prompt_lens)} prompt_lens; "
                "pass one prompt length per group"
            )
        if any(size < 1 for size in group_sizes):
            raise ValueError(f"group sizes must be >= 1, got {group_sizes}")
        first = self._num_rows
        total = sum(group_sizes)
        if self.max_rows is not None and first + total > self.max_rows:
            raise DockError(
                f"the dock table is full: dock.max_rows={self.max_rows} cannot take {total} new rows beside "
                f"the {first} it holds ({int((self._age[:first] > 0).sum())} carried over as unfinished); "
                "raise dock.max_rows (e.g. to 2 x rows per step for partial rollout) or add fewer prompts"
            )
        self._grow(first + total)
        row = first
        for group_size, prompt_len in zip(group_sizes, prompt_lens):
            self._append_group(row, group_size)
            self._lengths[PROMPT_LEN][row : row + group_size] = prompt_len
            self._age[row : row + group_size] = 0
            row += group_size
        self._num_rows = first + total
        self.latency.record("add_groups", time.perf_counter() - t0)
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
        self._age = grown(self._age, 0)
        self._lengths.setdefault(PROMPT_LEN, np.zeros(0, dtype=np.int64))
        self._lengths = {name: grown(a, -1) for name, a in self._lengths.items()}
        self._ready = {col: grown(a, False) for col, a in self._ready.items()}
        self._location = {col: grown(a, -1) for col, a in self._location.items()}
        self._consumed = {name: grown(a, False) for name, a in self._consumed.items()}
        self._dropped = grown(self._dropped, False)
        self._capacity = capacity

    # ---------------------------------------------------------------- producers

    def mark_ready(
        self,
        warehouse: int,
        rows: list[int],
        columns: list[str],
        lengths: dict[str, list[int]] | None = None,
    ) -> None:
        """Record that `warehouse` holds (or is being sent) `columns` for `rows`.

        `lengths` (e.g. {"response_len": [...]}, one value per row) update the per-row length metadata.
        A cell put again moves to the newest warehouse; a reader racing a re-put may see either value.
        """
        t0 = time.perf_counter()
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
        self.latency.record("mark_ready", time.perf_counter() - t0)

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
        balance_over: int = 1,
        policy: str | None = None,
        peer: int | None = None,
        near: list[int] | None = None,
    ) -> Allocation | None:
        """Serve up to `count` rows whose `columns` are all ready and that `consumer` has not taken yet.

        Served rows are marked consumed by `consumer` in the same call (exactly once per consumer; other
        consumers are independent). The policy (default: the controller's) orders the candidates; the
        allocation lists its rows ascending. Returns None when nothing can be served now.

        min_count (default `count`): serve only if at least this many rows can be served. Tail rule: when
        fewer than `min_count` rows are left unconsumed in the whole table, the remainder is served as soon
        as it is all ready. The tail rule trusts that the driver has added every group of the step.

        whole_groups: serve only groups whose rows are ALL ready (an incomplete group is never served); a
        group is never split across allocations. `count` and `min_count` stay in rows. When all groups have
        the same size g, both must be multiples of g (checked). With unequal sizes, `count` must be at least
        the largest group; groups are packed first-fit in policy order, and a batch that no further group
        could fit (more than count - largest_group rows) counts as full even if below `min_count`.

        balance_over=k (row mode): `consumer` is a stage served by k data-parallel peers that each ask for
        `count`. The first call that can take k x min_count rows (or the whole remainder) takes up to
        k x count, splits them into k bins of near-equal prompt+response tokens (policies.balanced_partition)
        and returns one; the next k-1 calls of that consumer get the other bins. With `peer` (0..k-1) each
        caller gets bin `peer` whichever calls first, so which rows a data-parallel rank trains on does not
        depend on timing (sums over ranks then run in the same order every run: bit-for-bit repeats).

        near: the warehouses on the caller's node (the clients send it). The `local` policy serves units held
        there first, cuts balanced bins by home warehouse (locality.local_partition, ordered by warehouse) and,
        without `peer`, hands each caller the bin held most on its node.
        """
        t0 = time.perf_counter()
        try:
            return self._allocate(
                consumer, columns, count, whole_groups, min_count, balance_over, policy, peer, near
            )
        finally:
            self.latency.record("allocate", time.perf_counter() - t0)

    def _allocate(self, consumer, columns, count, whole_groups, min_count, balance_over, policy, peer, near):
        min_count = count if min_count is None else min_count
        self._check_request(columns, count, min_count, whole_groups, balance_over)
        if peer is not None and not 0 <= peer < balance_over:
            raise ValueError(f"peer={peer} must be in 0..{balance_over - 1} (balance_over={balance_over})")
        local = self._is_local(policy)
        if self._planned.get(consumer):  # bins of an earlier call
            return self._planned_bin(consumer, peer, near if local else None)
        n = self._num_rows
        consumed = self._consumed_of(consumer)[:n]
        remaining = n - int(consumed.sum())
        if remaining == 0 or any(col not in self._ready for col in columns):
            return None
        ready = np.logical_and.reduce([self._ready[col][:n] for col in columns])
        count, min_count = count * balance_over, min_count * balance_over
        need = min(min_count, remaining)
        if whole_groups:
            need = min(need, count - max(self._group_sizes) + 1)
            rows = self._pick_groups(ready, consumed, count, policy, columns, near)
        else:
            rows = self._pick_rows(np.flatnonzero(ready & ~consumed), count, policy, columns, near)
        if rows.size == 0 or rows.size < need:
            return None
        consumed[rows] = True
        if balance_over == 1:
            return self._allocation(np.sort(rows), columns)
        held = self._held(rows, columns)
        if local:
            bins = local_partition(self._tokens(rows), held.argmax(axis=1), balance_over)
        else:
            bins = balanced_partition(self._tokens(rows), balance_over)
        self._planned[consumer] = {
            i: self._allocation(np.sort(rows[b]), columns) for i, b in enumerate(bins) if b.size
        }
        self._planned_held[consumer] = {i: held[b].sum(axis=0) for i, b in enumerate(bins) if b.size}
        return self._planned_bin(consumer, peer, near if local else None)

    def _planned_bin(self, consumer: str, peer: int | None, near: list[int] | None) -> Allocation | None:
        """One planned bin of `consumer`: bin `peer`; else the bin held most on `near`'s warehouses (the local
        policy), else the next in bin order. None if `peer`'s bin was empty (or already taken)."""
        planned, held = self._planned[consumer], self._planned_held[consumer]
        if peer is not None:
            key = peer
        elif near:
            key = max(planned, key=lambda i: (held[i][near].sum() / max(held[i].sum(), 1e-12), -i))
        else:
            key = next(iter(planned))
        held.pop(key, None)
        return planned.pop(key, None)

    def _is_local(self, policy: str | None) -> bool:
        return (self._policy_name if policy is None else policy) == LOCAL

    def _held(self, rows: np.ndarray, columns: list[str]) -> np.ndarray:
        """[rows, warehouses]: the elements of each row's `columns` each warehouse holds (locality.py)."""
        return held_by_warehouse(rows, columns, self._location, self._lengths, self.num_warehouses)

    def _allocation(self, rows: np.ndarray, columns: list[str]) -> Allocation:
        return Allocation(
            rows=rows.tolist(), locations={col: self._location[col][rows].tolist() for col in columns}
        )

    def _tokens(self, rows: np.ndarray) -> np.ndarray:
        """prompt_len + response_len per row (unknown lengths count as 0)."""
        total = np.zeros(rows.size, dtype=np.int64)
        for name in (PROMPT_LEN, RESPONSE_LEN):
            if name in self._lengths:
                total += np.maximum(self._lengths[name][rows], 0)
        return total

    def _pick_rows(
        self,
        eligible: np.ndarray,
        count: int,
        policy: str | None,
        columns: list[str],
        near: list[int] | None,
    ) -> np.ndarray:
        if policy is None and self._policy_name == "first":
            return eligible[:count]  # the common case stays a slice
        units = Candidates(
            first_rows=eligible,
            sizes=np.ones(eligible.size, dtype=np.int64),
            tokens=self._tokens(eligible),
            ages=self._age[eligible],
            count=count,
            near=near_share(self._held(eligible, columns), near),
        )
        order = checked_order(self._resolve(policy), units)
        return eligible[order[:count]]

    def _resolve(self, policy: str | None):
        return self._policy if policy is None else resolve_policy(policy, "allocate(policy=...)")

    def _check_request(
        self, columns: list[str], count: int, min_count: int, whole_groups: bool, balance_over: int
    ) -> None:
        if isinstance(columns, str) or not columns:
            raise ValueError(f"columns={columns!r} must be a non-empty list of column names")
        if balance_over < 1 or (balance_over > 1 and whole_groups):
            raise ValueError(
                f"balance_over={balance_over} must be >= 1, and 1 with whole_groups (bins are balanced by rows)"
            )
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
            self._consumed[consumer] = self._dropped.copy()  # a dropped row is never served
        return self._consumed[consumer]

    def drop(self, rows: list[int]) -> int:
        """Take rows out of the step: no consumer (present or future) is served them again, and they do not
        count as unconsumed. For whole groups that carry no signal (DAPO dynamic sampling drops groups whose
        rewards are all equal). Returns the number of rows dropped so far this step."""
        index = self._row_index(rows)
        self._dropped[index] = True
        for consumed in self._consumed.values():
            consumed[index] = True
        return int(self._dropped[: self._num_rows].sum())

    def _pick_groups(
        self,
        ready: np.ndarray,
        consumed: np.ndarray,
        count: int,
        policy: str | None,
        columns: list[str],
        near: list[int] | None,
    ) -> np.ndarray:
        """Whole groups (all rows ready, some unconsumed), first-fit in policy order, up to `count` rows."""
        starts = np.asarray(self._group_starts, dtype=np.int64)
        sizes = np.asarray(self._group_sizes, dtype=np.int64)
        num_ready = np.add.reduceat(ready.astype(np.int64), starts)
        num_unconsumed = np.add.reduceat((~consumed).astype(np.int64), starts)
        groups = np.flatnonzero((num_ready == sizes) & (num_unconsumed > 0))
        if groups.size == 0:
            return np.zeros(0, dtype=np.int64)
        all_rows = np.arange(consumed.size)
        row_tokens = self._tokens(all_rows)
        group_held = np.add.reduceat(self._held(all_rows, columns), starts, axis=0)[groups]
        units = Candidates(
            first_rows=starts[groups],
            sizes=num_unconsumed[groups],
            tokens=np.add.reduceat(row_tokens, starts)[groups],
            ages=self._age[starts[groups]],
            count=count,
            near=near_share(group_held, near),
        )
        order = checked_order(self._resolve(policy), units)
        picked = []
        for unit in pack(order, units.sizes, count):
            start, size = starts[groups[unit]], sizes[groups[unit]]
            # Normally the whole group; fewer only if this consumer also took single rows of it.
            picked.append(start + np.flatnonzero(~consumed[start : start + size]))
        return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)

    def peek(self, columns: list[str]) -> Allocation:
        """Every row (not dropped) whose `columns` are all ready, ascending, marking nothing consumed: a read
        that no consumer sees and that can be repeated (a checkpoint reads the steps in flight this way, at
        every save until they train)."""
        if isinstance(columns, str) or not columns:
            raise ValueError(f"columns={columns!r} must be a non-empty list of column names")
        n = self._num_rows
        if any(col not in self._ready for col in columns):
            return Allocation(rows=[], locations={col: [] for col in columns})
        ready = np.logical_and.reduce([self._ready[col][:n] for col in columns])
        return self._allocation(np.flatnonzero(ready & ~self._dropped[:n]), columns)

    def poll(
        self,
        consumer: str,
        columns: list[str],
        count: int,
        **options,
    ) -> tuple[Allocation | None, bool]:
        """`allocate` (same options), plus whether `consumer` has consumed every row: one round trip for a
        polling client.

        Returns (allocation, False) when served, (None, True) when nothing more will ever come, and
        (None, False) when the caller should wait and retry.
        """
        allocation = self.allocate(consumer, columns, count, **options)
        if allocation is not None:
            return allocation, False
        return None, self.all_consumed(consumer)

    def all_consumed(self, consumer: str) -> bool:
        """True iff the table has rows and `consumer` has taken every one.

        An empty table is not "all consumed", so a worker loop started before the driver adds prompts waits
        instead of exiting.
        """
        n = self._num_rows
        return n > 0 and bool(self._consumed_of(consumer)[:n].all()) and not self._planned.get(consumer)

    # ---------------------------------------------------------------- introspection

    def num_rows(self) -> int:
        """Number of rows added since the last reset."""
        return self._num_rows

    def ages(self) -> list[int]:
        """Each row's age: the resets it has survived (partial rollout's carried groups), in row order."""
        return self._age[: self._num_rows].tolist()

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

    def unready_rows(self, columns: list[str], limit: int = 16) -> list[int]:
        """The first `limit` rows missing at least one of `columns` (what a timed-out consumer waits for)."""
        n = self._num_rows
        ready = np.logical_and.reduce(
            [self._ready[c][:n] if c in self._ready else np.zeros(n, dtype=bool) for c in columns]
        )
        return np.flatnonzero(~ready)[:limit].tolist()

    def rows_on(self, warehouse: int) -> list[int]:
        """Rows with at least one cell held by `warehouse` (the rows lost if it dies)."""
        n = self._num_rows
        held = np.zeros(n, dtype=bool)
        for location in self._location.values():
            held |= location[:n] == warehouse
        return np.flatnonzero(held).tolist()

    def stats(self) -> dict:
        """Counts for logs and error messages.

        Keys: num_rows, num_groups, ready (column -> rows ready), consumed (consumer -> rows taken),
        warehouse_cells (per warehouse, the number of ready (row, column) cells it holds), ages (age ->
        rows), dropped (rows taken out by `drop`), latency_ms (op -> p50_ms, p99_ms, count of the controller's own service times).
        """
        n = self._num_rows
        cells = np.zeros(self.num_warehouses, dtype=np.int64)
        for location in self._location.values():
            held = location[:n]
            cells += np.bincount(held[held >= 0], minlength=self.num_warehouses)
        ages, counts = np.unique(self._age[:n], return_counts=True)
        return {
            "num_rows": n,
            "num_groups": len(self._group_sizes),
            "ready": self.ready_counts(list(self._ready)),
            "consumed": {name: self.consumed_count(name) for name in self._consumed},
            "warehouse_cells": cells.tolist(),
            "ages": {int(a): int(c) for a, c in zip(ages, counts)},
            "dropped": int(self._dropped[:n].sum()),
            "latency_ms": self.latency.summary(),
        }
