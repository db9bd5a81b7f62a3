"""The dock's socket transport without Ray: replies never answer the wrong request, errors come back."""

import time

import pytest

from dockrl.dock import DockClient, DockError
from dockrl.dock.transport import ServiceHub, SocketTransport


class Counter:
    """A warehouse stand-in: get_cells answers how many calls it has served (slowly), or raises."""

    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = 0, fail

    def get_cells(self, request: dict) -> dict:
        self.calls += 1
        if self.fail:
            raise DockError("warehouse refused")
        time.sleep(0.2)
        return {"calls": [self.calls]}

    def unpicklable(self):
        return lambda: None


def socket_hub(target) -> ServiceHub:
    hub = ServiceHub(target)
    ServiceHub._local.pop(hub.address)  # force the socket path although the hub runs in this process
    return hub


def test_a_failed_gather_leaves_no_stale_reply_for_the_next_call():
    hubs = [socket_hub(Counter()), socket_hub(Counter(fail=True)), socket_hub(Counter())]
    endpoints = [(hub.address, hub.authkey) for hub in hubs]
    client = DockClient(None, [None, None], endpoints=endpoints, get_timeout_s=10.0)
    # Warehouse 0 raises; warehouse 1's reply is still in flight when the error propagates.
    refs = {0: client._request(0, "get_cells", {}), 1: client._request(1, "get_cells", {})}
    with pytest.raises(DockError, match="warehouse refused"):
        client._gather(refs, None, "get")
    # The next call to warehouse 1 from this thread gets its own reply (its 2nd call), not the 1st one.
    assert client._gather({1: client._request(1, "get_cells", {})}, None, "get") == {1: {"calls": [2]}}
    for hub in hubs:
        hub.close()


def test_remote_errors_and_unpicklable_replies_come_back_as_errors():
    hub = socket_hub(Counter())
    transport = SocketTransport(hub.address, hub.authkey)
    with pytest.raises(AttributeError):
        transport.call("no_such_method", timeout_s=5.0)
    with pytest.raises(TypeError, match="unpicklable"):
        transport.call("unpicklable", timeout_s=5.0)
    assert transport.call("get_cells", {}, timeout_s=5.0) == {"calls": [1]}  # the connection still works
    hub.close()
