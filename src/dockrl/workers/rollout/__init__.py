"""Generation engine: continuous batching over KV-cache slots on dockrl's own model code.

`RolloutEngine` (engine.py) is the engine; `generate` (sampler.py) the simple batch API on it; `sampling.py`
the per-row sampler and seeds; `dock_feed.py` serves rollout rows from the dock through an engine.
"""

from dockrl.workers.rollout.rollout_engine import Completion, Generation, Request, RolloutEngine
from dockrl.workers.rollout.sampler import generate
from dockrl.workers.rollout.sampling import SamplingParams

__all__ = ["Completion", "Generation", "Request", "RolloutEngine", "SamplingParams", "generate"]
