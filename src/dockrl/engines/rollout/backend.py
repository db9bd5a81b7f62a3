"""The rollout backend socket: what the dock feed (`dock_feed.serve_from_dock`) needs of a generation engine.

dockrl's continuous-batching `RolloutEngine` is one implementation; a second backend (vLLM) implements the
same methods and plugs in where `dock_feed.step_engine` builds the engine. Lifecycle of a backend:

    build once per model and cache size
    load_weights(named tensors)        whenever no request is running (after each update)
    add(request) ... step() ...        until has_work() is False; step() returns the samples it finished
    stats                              counters since the build (prefill calls, decode steps, ...)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from dockrl.engines.rollout.requests import Completion, Request


@runtime_checkable
class RolloutBackend(Protocol):
    """A generation engine the dock feed drives (see the module docstring)."""

    stats: dict[str, int]

    def add(self, request: Request) -> None:
        """Queue a request (prompt token ids, sampling params, one seed per sample)."""
        ...

    def step(self) -> list[Completion]:
        """Advance every running sample by one token (admitting what fits first); return those finished."""
        ...

    def num_free_slots(self) -> int:
        """Samples that could start now (slots not running and not claimed by waiting requests)."""
        ...

    def has_work(self) -> bool:
        """True while a request waits or a sample runs."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        """Make these (parameter name, full tensor) pairs the engine's weights; only while nothing runs."""
        ...
