"""Generation engine: continuous batching over KV-cache slots on dockrl's own model code.

`RolloutBackend` (backend.py) is the engine socket the dock feed drives, `Request` in and `Completion` out
(requests.py); `backends/` the registry of backends a run chooses from (`rollout.backend`); `RolloutEngine`
(rollout_engine.py) is dockrl's own engine; `generate` (sampler.py) the simple batch API on it; `sampling.py` the
per-row sampler and seeds; `dock_feed.py` serves rollout rows from the dock through a backend. The package
imports nothing heavy itself: the config reads the backends' registry (`backends/`) before any worker starts,
without torch.
"""

from typing import Any

_EXPORTS = {
    "RolloutBackend": "dockrl.engines.rollout.backend",
    "Completion": "dockrl.engines.rollout.requests",
    "Generation": "dockrl.engines.rollout.requests",
    "Request": "dockrl.engines.rollout.requests",
    "RolloutEngine": "dockrl.engines.rollout.rollout_engine",
    "generate": "dockrl.engines.rollout.sampler",
    "SamplingParams": "dockrl.engines.rollout.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dockrl.engines.rollout' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
