"""One rank per tensor-parallel group talks to the dock; it broadcasts what it read to its peers.

`ReplicaClient` is the DockAPI (dock/api.py) for the ranks of one tp group, over the dock client it wraps: the
head (lowest rank) makes every call and broadcasts its result, or the exception it raised, so every peer sees
the same rows (or raises the same error) at the same point of the same loop - the lockstep tensor
parallelism needs. Only the head writes back (a put is not broadcast: the peers hold the same results). With
a group of one it is a plain pass-through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from dockrl.dock.api import DockAPI, Pull

if TYPE_CHECKING:
    from dockrl.dock.stages import Stage

T = TypeVar("T")


class ReplicaClient(DockAPI):
    """Dock access for one rank of a tp group (see module docstring)."""

    def __init__(self, client: DockAPI, group: dist.ProcessGroup | None, rank: int, group_size: int) -> None:
        self.client = client
        self.group = group if group_size > 1 else None
        self.head_rank = rank - rank % group_size
        self.is_head = rank == self.head_rank

    def broadcast(self, value: Any) -> Any:
        """The head's `value` on every rank of the group."""
        if self.group is None:
            return value
        box = [value if self.is_head else None]
        dist.broadcast_object_list(box, src=self.head_rank, group=self.group)
        return box[0]

    def _on_head(self, call: Callable[[], T]) -> T:
        """`call()` on the head; its result (or exception) on every rank."""
        if self.group is None:
            return call()
        outcome: tuple[str, Any] | None = None
        if self.is_head:
            try:
                outcome = ("ok", call())
            except Exception as exc:  # re-raised on every rank below
                outcome = ("raise", exc)
        kind, value = self.broadcast(outcome)
        if kind == "raise":
            raise value
        return value

    def pull(self, request: Pull) -> tuple[list[int], dict[str, list]] | None:
        """`client.pull` on the head; its result (or exception) on every rank."""
        return self._on_head(lambda: self.client.pull(request))

    def put(self, producer: Stage, rows: list[int], batch: dict[str, list]) -> None:
        """`client.put` on the head only (peers hold the same results)."""
        if self.is_head:
            self.client.put(producer, rows, batch)

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """`client.add_groups` on the head; its row ids on every rank."""
        return self._on_head(lambda: self.client.add_groups(prompts, labels, group_size, extra=extra))

    def drop(self, rows: list[int]) -> int:
        """`client.drop` on the head; its count on every rank."""
        return self._on_head(lambda: self.client.drop(rows))

    def all_consumed(self, consumer: Stage) -> bool:
        """`client.all_consumed` on the head; its answer on every rank."""
        return self._on_head(lambda: self.client.all_consumed(consumer))

    def ages(self) -> list[int]:
        """`client.ages` on the head; its answer on every rank."""
        return self._on_head(self.client.ages)

    def stats(self) -> dict:
        """`client.stats` on the head; its answer on every rank."""
        return self._on_head(self.client.stats)

    def reset(self, keep_unfinished: str | None = None, served_by: Stage | None = None) -> list[int]:
        """`client.reset` on the head; the kept rows on every rank."""
        return self._on_head(lambda: self.client.reset(keep_unfinished, served_by))

    def check_warehouses(self) -> None:
        """`client.check_warehouses` on the head; its error (if any) on every rank."""
        self._on_head(self.client.check_warehouses)
