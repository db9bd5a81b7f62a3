"""Errors raised by the dock. Plain Python: no Ray import, so pure modules can catch them."""


class DockError(RuntimeError):
    """A dock operation failed (bad request, missing data, or a dock actor died)."""


class DockTimeoutError(DockError):
    """A blocking dock call waited longer than its timeout; the message names what it waited for."""


class WarehouseDiedError(DockError):
    """A dock actor (warehouse or controller) died; the message names the actor and the rows affected."""


class StaleHandleError(DockError):
    """A dock actor was re-created (or restarted by Ray) since this client got its handle: its state is gone."""
