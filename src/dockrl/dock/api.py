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

from typing import Protocol, runtime_checkable

from dockrl.dock.stages import Stage


@runtime_checkable
class DockAPI(Protocol):
    """Put and get rows of the current step's table (the lifecycle is DockController's: reset, add_groups,
    puts and gets by the stages, reset)."""

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """The driver adds one group of `group_size` rows per prompt (prompt_ids, label and `extra` columns
        the driver produces); returns all row ids, group i = rows[i*g:(i+1)*g]."""
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
        """Stage `consumer` takes up to `count` rows whose `columns` are ready and that it has not taken
        (DockController.allocate); (rows, {column: values in row order}), or None once it has taken every
        row. Raises DockTimeoutError after `timeout_s` (default: the client's get timeout). With `balance_over`
        = k, `peer` (0..k-1) takes bin `peer` of the balanced split (None: bins in call order)."""
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
