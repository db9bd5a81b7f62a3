"""One rank per tensor-parallel group talks to the dock; it broadcasts what it read to its peers.

`ReplicaClient` wraps a dock client (anything with `get` / `put`) for the ranks of one tp group: the head
(lowest rank) calls the real client and broadcasts the result, or the exception it raised, so every peer
sees the same rows (or raises the same error) at the same point of the same loop - the lockstep tensor
parallelism needs. Only the head writes back. With a group of one it is a plain pass-through.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class ReplicaClient:
    """Dock access for one rank of a tp group (see module docstring)."""

    def __init__(self, client: Any, group: dist.ProcessGroup | None, rank: int, group_size: int) -> None:
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

    def get(self, *args: Any, **kwargs: Any) -> Any:
        """`client.get` on the head; its result (or exception) on every rank."""
        if self.group is None:
            return self.client.get(*args, **kwargs)
        outcome = None
        if self.is_head:
            try:
                outcome = ("ok", self.client.get(*args, **kwargs))
            except Exception as exc:  # re-raised on every rank below
                outcome = ("raise", exc)
        kind, value = self.broadcast(outcome)
        if kind == "raise":
            raise value
        return value

    def put(self, rows: list[int], columns: dict[str, list]) -> None:
        """`client.put` on the head only (peers hold the same results)."""
        if self.is_head:
            self.client.put(rows, columns)
