"""The distributed transfer dock: controller (metadata), warehouses (payload), clients (put/get, one DockAPI),
the column schema and the Stage names of its producers and consumers.

Importing this package does not import Ray; DockClient, Dock and launch_dock load it on first access.
"""

from dockrl.dock.api import DockAPI
from dockrl.dock.choice import DockChoice
from dockrl.dock.controller import Allocation, DockController
from dockrl.dock.errors import DockError, DockTimeoutError, StaleHandleError, WarehouseDiedError
from dockrl.dock.policies import Candidates, balanced_partition, resolve_policy
from dockrl.dock.stages import Stage
from dockrl.dock.warehouse import Warehouse

_RAY_EXPORTS = {
    "DockClient": "dockrl.dock.client",
    "Dock": "dockrl.dock.launch",
    "launch_dock": "dockrl.dock.launch",
    "CentralDockHandle": "dockrl.dock.launch",
}


def __getattr__(name: str):
    if name in _RAY_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_RAY_EXPORTS[name]), name)
    raise AttributeError(f"module 'dockrl.dock' has no attribute {name!r}")


__all__ = [
    "Allocation",
    "Candidates",
    "CentralDockHandle",
    "Dock",
    "DockAPI",
    "DockChoice",
    "DockClient",
    "DockController",
    "DockError",
    "DockTimeoutError",
    "Stage",
    "Warehouse",
    "StaleHandleError",
    "WarehouseDiedError",
    "balanced_partition",
    "launch_dock",
    "resolve_policy",
]
