"""DockAPI: the one interface every dock client offers, whatever stands behind it.

```
 DockClient     (client.py)   dock mode: a controller + warehouses, payload straight to/from them
 CentralClient  (central.py)  single / driver mode: one store holds data and metadata
 DockChoice     (choice.py)   several docks (asynchronous runs), one selected
 ReplicaClient  (parallel/replica.py)  one rank of a tensor-parallel group: the head reads, its peers get it
```

Recipes, workers, engines and benchmarks hold a DockAPI (or a DockChoice), never a concrete client, so a test
can pass a small fake. Every producer and consumer names itself as a Stage: each client checks a put's
producer and a get's consumer against the column schema (columns.py) before any request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dockrl.dock.stages import Stage


@dataclass(frozen=True)
class Pull:
    """One read of the dock by stage `consumer`: up to `count` rows whose `columns` are ready and that it has not
    taken (DockController.allocate). whole_groups / min_count: whole groups only, and at least that many rows
    (the tail excepted); timeout_s: the longest wait (None: the client's get timeout); balance_over = k: the
    stage's k data-parallel peers share k x count rows in token-balanced bins, `peer` (0..k-1) taking bin
    `peer` (None: bins in call order); policy: the allocation policy for this read (None: the dock's)."""

    consumer: Stage
    columns: list[str]
    count: int
    whole_groups: bool = False
    min_count: int | None = None
    timeout_s: float | None = None
    balance_over: int = 1
    policy: str | None = None
    peer: int | None = None


class RowSource(Protocol):
    """What a stage loop needs of a dock: reads (`pull`, or `get` with the same fields) and writes (`put`).
    Implemented by every dock client and by in-process row sources (multi_turn.LocalRows)."""

    def pull(self, request: Pull) -> tuple[list[int], dict[str, list]] | None:
        """Serve `request` (a Pull): (rows, {column: values in row order}) once rows are ready, or None once
        its consumer has taken every row. Raises DockTimeoutError after its timeout."""
        ...

    def put(self, producer: Stage, rows: list[int], batch: dict[str, list]) -> None:
        """Stage `producer` writes `batch[column][i]` for row `rows[i]`; visible to `get` on return."""
        ...

    def get(
        self,
        consumer: Stage,
        columns: list[str],
        count: int,
        *,
        whole_groups: bool = False,
        min_count: int | None = None,
        timeout_s: float | None = None,
        balance_over: int = 1,
        policy: str | None = None,
        peer: int | None = None,
    ) -> tuple[list[int], dict[str, list]] | None:
        """`pull` of the Pull these arguments make (the one place its fields are spelled out as arguments)."""
        request = Pull(
            consumer, list(columns), count, whole_groups, min_count, timeout_s, balance_over, policy, peer
        )
        return self.pull(request)


@runtime_checkable
class DockAPI(RowSource, Protocol):
    """Put and get rows of the current step's table (the lifecycle is DockController's: reset, add_groups,
    puts and gets by the stages, reset)."""

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """The driver adds one group of `group_size` rows per prompt (prompt_ids, label and `extra` columns
        the driver produces); returns all row ids, group i = rows[i*g:(i+1)*g]."""
        ...

    def drop(self, rows: list[int]) -> int:
        """Take rows out of the step (DockController.drop); returns the rows dropped so far."""
        ...

    def all_consumed(self, consumer: Stage) -> bool:
        """True iff the table has rows and `consumer` has taken them all."""
        ...

    def ages(self) -> list[int]:
        """Each row's age (resets survived), in row order."""
        ...

    def stats(self) -> dict:
        """Controller stats plus "warehouses", "mode" and this process's "client" counters."""
        ...

    def reset(self, keep_unfinished: str | None = None, served_by: Stage | None = None) -> list[int]:
        """Start the next step's table; with `keep_unfinished` (a column) groups lacking it stay (partial
        rollout), their rows with it counted as served to `served_by`. Returns the kept old row ids."""
        ...

    def check_warehouses(self) -> None:
        """Raise a DockError if the store (a warehouse, the controller) is gone."""
        ...
