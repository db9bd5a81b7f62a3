"""Generation engine: continuous batching over KV-cache slots on dockrl's own model code.

`RolloutBackend` (backend.py) is the socket a generation engine plugs into; `RolloutEngine`
(rollout_engine.py) is dockrl's own; `generate` (sampler.py) the simple batch API on it; `sampling.py` the
per-row sampler and seeds; `dock_feed.py` serves rollout rows from the dock through a backend.
"""

from dockrl.engines.rollout.backend import RolloutBackend
from dockrl.engines.rollout.rollout_engine import Completion, Generation, Request, RolloutEngine
from dockrl.engines.rollout.sampler import generate
from dockrl.engines.rollout.sampling import SamplingParams

__all__ = [
    "Completion",
    "RolloutBackend",
    "Generation",
    "Request",
    "RolloutEngine",
    "SamplingParams",
    "generate",
]
