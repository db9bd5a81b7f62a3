"""DockChoice: the clients of several docks, one of them selected; everything else is the selected client's.

Asynchronous training (rollout.max_staleness=1) keeps two docks: while the actor trains on step t's rows in
one, the rollout replicas and reward workers fill the other with step t+1's. Every worker gets a DockChoice
as its client and the recipe tells each group which dock a stage reads (`Worker.select_dock`), so a worker's
code never knows there are two.
"""

from __future__ import annotations

from typing import Any


class DockChoice:
    """A client-shaped view of `clients[selected]`."""

    def __init__(self, clients: list[Any]) -> None:
        self.clients, self.selected = list(clients), 0

    def select(self, index: int) -> None:
        """Direct every later call to `clients[index]`."""
        if not 0 <= index < len(self.clients):
            raise IndexError(f"dock {index} of {len(self.clients)}")
        self.selected = index

    def __getattr__(self, name: str) -> Any:
        if name in ("clients", "selected"):  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.clients[self.selected], name)
