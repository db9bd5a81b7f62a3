"""The rollout-backend socket: which engine generates, chosen once by `rollout.backend`.

```
 rollout.backend ──▶ BACKENDS[name]: a record (this package, no torch, read by the config before any process):
     settings          its section of the config, rollout.<name>.* (None: it has none)
     settings_problems, install_problem, model_problem   its checks, made before any process starts
     full_tensors, records_routes                         traits the workers read instead of its name
     rollout           "module:Class" of its implementation in engines/rollout/, built by a worker:
 colocated(spec, host) / replica(spec, host) ──▶ a Rollout, all a worker calls:
     sync(source)   after an update: take the weights from the switch or the received buffers (WeightSource)
     engine()       the RolloutBackend the dock feed drives (engines/rollout/backend.py)
     release(free)  after a rollout: free the KV cache (and its weights) when asked
     generate(...)  held-out prompts outside the dock (evaluation)
```

A third backend (e.g. SGLang) is a record module here, its Rollout in engines/rollout/, and one line in
BACKENDS (plus the line of its settings section in `RolloutConfig` when it has settings). The record names its
implementation by path: this package sits below config and engines, and imports neither.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

BACKENDS: dict[str, str] = {
    "dockrl": "dockrl.backends.dockrl:BACKEND",
    "vllm": "dockrl.backends.vllm:BACKEND",
}

WeightPairs = Iterable[tuple[str, Any]]  # (Hugging Face parameter name, full tensor)


class WeightSource(Protocol):
    """Where a rollout's weights come from after an update: the colocated switch (an actor rank) or the
    buffers a separate replica received."""

    def in_place(self) -> int:
        """Make the model the dockrl engine reads hold the new weights; returns the bytes this rank holds."""
        ...

    def stream(self, load: Callable[[WeightPairs], dict[str, float]]) -> dict[str, float]:
        """Hand the new weights to `load` as (name, full tensor) pairs, one bucket at a time; its result."""
        ...

    def reference(self, ids: Any) -> Any:
        """The source's own log-probs of ids[1:] given the tokens before each (a backend checks its copy)."""
        ...


class Rollout(Protocol):
    """One worker's generation engine over its lifetime (see the module docstring)."""

    def sync(self, source: WeightSource) -> dict[str, float]:
        """Take the weights after an update from `source`; returns what the load reports ({} when the engine
        reads the weights in place): "seconds", "bytes", "probe_abs_diff", "digest_tensors"."""
        ...

    def engine(self) -> Any:
        """The RolloutBackend the dock feed drives (built on first use)."""
        ...

    def release(self, free_memory: bool) -> None:
        """The rollout is over: with `free_memory`, give back the KV cache (and the weights, where it holds a
        copy of its own) until the next sync."""
        ...

    def generate(
        self, prompts: list[list[int]], params: Any, seeds: list[int], images: list | None = None
    ) -> list[Any]:
        """One completion (a Generation) per prompt outside the dock (held-out evaluation), in prompt order; a
        vision model's prompts with their images (per prompt (uint8 patches, grid) or None)."""
        ...


@dataclass(frozen=True)
class RolloutHost:
    """What a worker hands a backend to build its rollout: the model whose weights the switch (or the received
    buffers) fill, the tokenizer's decode, the pad token, the device, and the ranks that share one engine."""

    model: Any  # dockrl's Transformer
    decode: Callable[[list[int]], str]
    pad_token_id: int
    device_type: str  # "cpu" or "cuda"
    world: int  # the actor's ranks (each its own engine, rollout.tp of them per replica); 1 for a replica
    name: str  # the worker's name, for the backend's logs and errors
    vision: Any = None  # a vision model's VisionInputs (models/vision.py): its rows' images reach the prefill


class Backend:
    """A backend's record; a backend module subclasses it and sets the attributes (see the module docstring)."""

    name: str = ""
    settings: type | None = None  # the dataclass of rollout.<name>.*, or None
    full_tensors: bool = False  # the colocated switch streams whole tensors (the backend cuts its tp slices)
    records_routes: bool = False  # MoE: its engine records each token's experts (routing replay)
    rollout: str = ""  # "module:Class" of its Rollout (constructed as Class(spec, host))

    def settings_problems(self, settings: Any) -> list[tuple[str, Any, str, str]]:
        """(key, value, problem, fix) for each setting of its section that cannot work."""
        return []

    def unfiltered_logprobs(self, temperature: float) -> bool:
        """Whether its rollout_logprobs at this rollout.temperature are dockrl's quantity whatever the filters:
        log_softmax(logits / temperature) over the whole vocabulary, before top_k / top_p / min_p (what the
        trainer recomputes). False: with a filter on, they are another distribution's (the config refuses the
        corrections that read them)."""
        return True

    def install_problem(self) -> str | None:
        """Why it cannot run on this machine (a package missing, another version), or None."""
        return None

    def model_problem(self, args: Any, device_type: str) -> str | None:
        """Why it cannot serve a model of these ModelArgs on this device, or None."""
        return None

    def colocated(self, spec: Any, host: RolloutHost) -> Rollout:
        """The rollout of an actor rank (spec: a RolloutSpec; host.model: the switch's inference model)."""
        return self._build(spec, host)

    def replica(self, spec: Any, host: RolloutHost) -> Rollout:
        """The rollout of a separate replica (host.model: the model on the buffers it receives)."""
        return self._build(spec, host)

    def _build(self, spec: Any, host: RolloutHost) -> Rollout:
        module, _, name = self.rollout.partition(":")
        return getattr(importlib.import_module(module), name)(spec, host)


def names() -> tuple[str, ...]:
    """The registered backends' names."""
    return tuple(BACKENDS)


def backend(name: str) -> Backend:
    """The backend registered as `name` (its record's module imported now); KeyError naming the registered ones."""
    if name not in BACKENDS:
        raise KeyError(f"no rollout backend {name!r}; registered: {sorted(BACKENDS)}")
    module, _, attribute = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)
