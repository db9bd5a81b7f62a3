"""DockChoice: the clients of several docks, one of them selected; every DockAPI call goes to the selected one.

Asynchronous training (rollout.max_staleness=1) keeps two docks: while the actor trains on step t's rows in
one, the rollout replicas and reward workers fill the other with step t+1's. Every worker gets a DockChoice
as its client and the recipe tells each group which dock a stage reads (`WorkerGroup.select_dock`), so a
worker's code never knows there are two. A synchronous run's choice holds its one dock.
"""

from __future__ import annotations

from dockrl.dock.api import DockAPI, Pull
from dockrl.dock.stages import Stage


class DockChoice(DockAPI):
    """The DockAPI of `clients[selected]` (see api.py), plus `select`."""

    def __init__(self, clients: list[DockAPI]) -> None:
        if not clients:
            raise ValueError("DockChoice needs at least one dock client")
        self.clients, self.selected = list(clients), 0

    def select(self, index: int) -> None:
        """Direct every later call to `clients[index]`."""
        if not 0 <= index < len(self.clients):
            raise IndexError(f"dock {index} of {len(self.clients)}")
        self.selected = index

    @property
    def current(self) -> DockAPI:
        """The selected dock's client."""
        return self.clients[self.selected]

    def add_groups(
        self, prompts: list, labels: list, group_size: int, *, extra: dict[str, list] | None = None
    ) -> list[int]:
        """DockAPI.add_groups on the selected dock."""
        return self.current.add_groups(prompts, labels, group_size, extra=extra)

    def put(self, producer: Stage, rows: list[int], batch: dict[str, list]) -> None:
        """DockAPI.put on the selected dock."""
        self.current.put(producer, rows, batch)

    def peek(self, columns: list[str]) -> tuple[list[int], dict[str, list]]:
        """Every ready row of `columns` on the selected dock, consuming nothing (the driver's checkpoint read;
        DockClient.peek and CentralClient.peek)."""
        client = self.current
        peek = getattr(client, "peek", None)
        if peek is None:
            raise TypeError(
                f"{type(client).__name__} cannot peek: a checkpoint reads through the driver's client"
            )
        return peek(columns)

    def pull(self, request: Pull) -> tuple[list[int], dict[str, list]] | None:
        """DockAPI.pull on the selected dock."""
        return self.current.pull(request)

    def drop(self, rows: list[int]) -> int:
        """DockAPI.drop on the selected dock."""
        return self.current.drop(rows)

    def all_consumed(self, consumer: Stage) -> bool:
        """DockAPI.all_consumed on the selected dock."""
        return self.current.all_consumed(consumer)

    def ages(self) -> list[int]:
        """DockAPI.ages on the selected dock."""
        return self.current.ages()

    def stats(self) -> dict:
        """DockAPI.stats on the selected dock."""
        return self.current.stats()

    def reset(self, keep_unfinished: str | None = None, served_by: Stage | None = None) -> list[int]:
        """DockAPI.reset on the selected dock."""
        return self.current.reset(keep_unfinished, served_by)

    def check_warehouses(self) -> None:
        """DockAPI.check_warehouses on the selected dock."""
        self.current.check_warehouses()
