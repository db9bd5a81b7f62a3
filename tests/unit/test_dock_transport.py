"""The dock's socket transport without Ray: replies never answer the wrong request, errors come back, a
connection that does not authenticate is bounded in time and number, and every frame is authenticated."""

import multiprocessing
import pickle
import socket
import time

import pytest

from dockrl.dock import DockClient, DockError, transport
from dockrl.dock.transport import BadFrame, ServiceHub, SocketTransport


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


# ---------------------------------------------------------------- handshake bounds and frame authentication


class _Unpickled(Exception):
    """Raised by a payload's unpickling: it shows the receiver unpickled a frame it should have refused."""


def _explode():
    raise _Unpickled("a refused frame was unpickled")


class _Bomb:
    def __reduce__(self):
        return (_explode, ())


def _raw_connection(hub) -> socket.socket:
    return socket.create_connection(hub.address, timeout=5.0)


def test_a_connection_that_never_authenticates_is_dropped(monkeypatch):
    """The hub shuts a connection that has not finished the handshake within CONNECT_TIMEOUT_S."""
    monkeypatch.setattr(transport, "CONNECT_TIMEOUT_S", 0.5)
    hub = socket_hub(Counter())
    idle = _raw_connection(hub)
    start = time.monotonic()
    received = b""
    while chunk := idle.recv(4096):  # the challenge, then end of stream when the hub gives up
        received += chunk
    assert received and time.monotonic() - start < 4.0
    idle.close()
    assert SocketTransport(hub.address, hub.authkey).call("get_cells", {}, timeout_s=5.0) == {"calls": [1]}
    hub.close()


def test_unauthenticated_connections_are_capped(monkeypatch):
    """With MAX_HANDSHAKES=2, a third unauthenticated connection gets no challenge while two are pending; it
    is served once one of them goes away, and a pending one is shut down after CONNECT_TIMEOUT_S. The first two
    handshakes get a timeout far beyond the test, so a loaded host cannot free their slots early."""
    monkeypatch.setattr(transport, "MAX_HANDSHAKES", 2)
    monkeypatch.setattr(transport, "CONNECT_TIMEOUT_S", 600.0)
    hub = socket_hub(Counter())
    first, second = _raw_connection(hub), _raw_connection(hub)
    assert first.recv(4096) and second.recv(4096)  # both got a challenge
    third = _raw_connection(hub)
    third.settimeout(0.5)
    with pytest.raises(socket.timeout):
        third.recv(4096)
    monkeypatch.setattr(transport, "CONNECT_TIMEOUT_S", 0.5)  # the handshakes started from now on
    first.close()  # its handshake fails: a slot frees
    third.settimeout(30.0)
    assert third.recv(4096)  # the third is served
    assert third.recv(4096) == b""  # and shut down by the watchdog, never having answered
    for sock in (second, third):
        sock.close()
    hub.close()


def _frames(key: bytes, direction: bytes, *messages) -> list[bytes]:
    """The frames a channel with `key` sends for `messages`, in order, as they arrive at the other end."""
    sender, reader = multiprocessing.Pipe()
    channel = transport._Channel(sender, key, direction, b"?")
    for message in messages:
        channel.send(message)
    frames = [reader.recv_bytes() for _ in messages]
    channel.close()
    reader.close()
    return frames


@pytest.mark.parametrize("attack", ["tampered", "replayed", "reordered", "reflected", "other_session"])
def test_frames_that_fail_authentication_are_refused_before_unpickling(attack):
    """Every frame carries HMAC(session key, direction | sequence number | payload): a changed byte, a frame
    sent again, two frames swapped, the hub's own frame sent back to it, or a frame of another connection
    (another session key) is refused with BadFrame before its payload (here one that raises when unpickled)
    is read, and the connection is closed."""
    key = b"k" * 32
    first, second = _frames(key, transport._TO_HUB, ("get_cells", ({},), {}), ("get_cells", (_Bomb(),), {}))
    deliveries = {
        "tampered": [first, second[:-1] + bytes([second[-1] ^ 1])],
        "replayed": [first, first],
        "reordered": [second, first],
        "reflected": _frames(key, transport._TO_CLIENT, ("get_cells", (_Bomb(),), {})),
        "other_session": _frames(b"x" * 32, transport._TO_HUB, ("get_cells", (_Bomb(),), {})),
    }[attack]
    hub_end, attacker = multiprocessing.Pipe()
    hub = transport._Channel(hub_end, key, transport._TO_CLIENT, transport._TO_HUB)
    for data in deliveries:
        attacker.send_bytes(data)
    if deliveries[0] is first:
        assert hub.recv() == ("get_cells", ({},), {})  # the genuine first frame is accepted, once
    with pytest.raises(BadFrame, match="failed authentication"):
        hub.recv()
    assert hub_end.closed


def test_the_hub_refuses_an_injected_frame_and_closes_the_connection():
    """On a live connection, a frame injected without the session key never reaches the target."""
    counter = Counter()
    hub = socket_hub(counter)
    client = SocketTransport(hub.address, hub.authkey)
    assert client.call("get_cells", {}, timeout_s=5.0) == {"calls": [1]}
    channel = client._threads.channel
    payload = pickle.dumps(("get_cells", (_Bomb(),), {}))
    channel.connection.send_bytes(b"\0" * 32 + payload)  # a forged tag
    assert channel.connection.poll(5.0)
    with pytest.raises(EOFError):  # the hub closed the connection without answering
        channel.connection.recv_bytes()
    assert counter.calls == 1
    assert SocketTransport(hub.address, hub.authkey).call("get_cells", {}, timeout_s=5.0) == {"calls": [2]}
    hub.close()
