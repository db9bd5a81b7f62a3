"""Ray actor classes, made once per process (the dock's and the workers')."""

from __future__ import annotations

from typing import Any

import ray

_MADE: dict[tuple[type, tuple[tuple[str, int], ...]], Any] = {}


def remote_class(cls: type, concurrency_groups: tuple[tuple[str, int], ...] = ()) -> Any:
    """`ray.remote(cls)` made once per process: Ray exports a class to each new session on its first use
    anyway, and making it again for every worker group re-exports it (about half a second of driver CPU
    per class, every run of a process that runs many)."""
    key = (cls, concurrency_groups)
    if key not in _MADE:
        # ray.remote's typed overloads omit concurrency_groups, which it takes (an actor option).
        if concurrency_groups:
            groups = dict(concurrency_groups)
            made = ray.remote(concurrency_groups=groups)(cls)  # type: ignore[call-overload]
        else:
            made = ray.remote(cls)
        _MADE[key] = made
    return _MADE[key]
