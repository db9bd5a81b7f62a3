"""dockrl's own continuous-batching engine as a rollout backend (`rollout.backend: dockrl`, the default).

No settings section and nothing to check; it records MoE routes for routing replay, and the switch hands it each
rank's rollout.tp slices (engines/rollout/dockrl_rollout.py is its implementation).
"""

from __future__ import annotations

from dockrl.backends import Backend


class DockrlEntry(Backend):
    """The record (backends.Backend)."""

    name = "dockrl"
    full_tensors = False  # the switch gathers each rank's rollout.tp slice itself
    records_routes = True
    rollout = "dockrl.engines.rollout.dockrl_rollout:DockrlRollout"


BACKEND = DockrlEntry()
