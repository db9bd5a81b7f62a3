"""dockrl's own engine behind the rollout-backend socket (backends/dockrl.py is its record).

The engine decodes on the model the weights already sit in: an actor rank's switch fills its inference model in
place (`WeightSource.in_place`), a separate replica's received buffers are its model's.
"""

from __future__ import annotations

from typing import Any

from dockrl.backends import RolloutHost, WeightSource
from dockrl.engines.rollout.dock_feed import step_engine
from dockrl.engines.rollout.sampler import generate


class DockrlRollout:
    """A worker's dockrl engine (see the module docstring); built at the first rollout after a sync."""

    def __init__(self, spec: Any, host: RolloutHost) -> None:
        self.spec, self.host = spec, host
        self._engine: Any = None

    def sync(self, source: WeightSource) -> dict[str, float]:
        """The weights go into the model in place: nothing is loaded into the engine, so nothing to report; an
        engine that lives on is told (its packed weights and kept KV are of the old ones)."""
        source.in_place()
        if self._engine is not None:
            self._engine.weights_changed()
        return {}

    def engine(self) -> Any:
        """The continuous-batching engine on the host's model (dock_feed.step_engine)."""
        if self._engine is None:
            self._engine = step_engine(
                self.host.model, self.spec, self.host.pad_token_id, self.host.decode, self.host.vision
            )
        return self._engine

    def release(self, free_memory: bool) -> None:
        """With `free_memory` the engine goes, and its KV cache with it (rebuilt at the next rollout)."""
        if free_memory:
            self._engine = None

    def generate(
        self, prompts: list[list[int]], params: Any, seeds: list[int], images: list | None = None
    ) -> list[Any]:
        """Held-out prompts on a batch engine of their own (rollout.max_batch_size sequences at once); a vision
        model's prompts with their images (per prompt (uint8 patches, grid) or None)."""
        return generate(
            self.host.model,
            prompts,
            params,
            seeds,
            pad_token_id=self.host.pad_token_id,
            max_batch_size=self.spec.max_batch_size,
            vision=self.host.vision,
            images=images,
        )
