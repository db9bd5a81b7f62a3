"""How dock clients reach the controller and the warehouses: direct sockets (default) or Ray actor calls.

```
 socket:  client thread ──own TCP connection──▶ ServiceHub thread in the actor's process ──▶ method
 ray:     client ──actor.method.remote()──▶ Ray core worker ──▶ method   (payload through the object store)
```

Both give `request(method, *args, **kwargs) -> Pending` with `.result(timeout_s)` and `.abandon()`, so a
client sends to every warehouse first and then collects the replies (the calls overlap). `request` never
raises: a send that fails gives a Pending whose `result` raises. Failures come out
as two exceptions the client turns into errors that name the actor and the rows: `Lost` (the peer's process
is gone: connection refused/reset/closed, or RayActorError) and `NoReply` (no answer within the timeout).

Why sockets: a Ray actor call costs ~1-2 ms of scheduling and object-store work here, and payloads over
100 KB detour through the object store; a direct connection costs one pickle and one send. The actors stay
Ray actors (placement, lifecycle, names, incarnations); only the request path changes. A hub serves each
connection on its own thread (handshake included, so a stalled client blocks nobody else), so the target
must be thread-safe (Warehouse and SharedController are). Every wait is bounded: connecting and the
handshake by CONNECT_TIMEOUT_S (the hub drops a connection that has not authenticated by then, and runs at
most MAX_HANDSHAKES handshakes at once; later connections wait in the listen backlog), replies by the
caller's timeout, a peer whose node vanished mid-message by TCP keepalive / user timeout. No Ray import at
module level: the central modes (driver hub) use it too.

Authentication: the hub's random key (shipped to clients inside their pickled transports) authenticates both
ends with multiprocessing's HMAC challenge in both directions; each end then sends a fresh nonce, and every
frame after that carries HMAC-SHA256(session key, direction | sequence number | payload), checked before the
payload is unpickled. A tampered, replayed (from this or another connection) or reordered frame raises
BadFrame and closes the connection. Frames are not encrypted: a dock carries rollouts, not secrets, but the
key must stay private (any holder can run code in the hub's process through pickle).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

CONNECT_TIMEOUT_S = 30.0
MAX_HANDSHAKES = 64  # unauthenticated connections a hub serves at once
_TAG_BYTES = 32  # HMAC-SHA256
_NONCE_BYTES = 16
_TO_HUB, _TO_CLIENT = b"C", b"S"  # frame directions
# multiprocessing.connection's length prefix: a signed 32-bit size, or -1 and an unsigned 64-bit size.
_SIZE, _LONG, _LONG_SIZE, _SIZE_MAX = (
    struct.Struct("!i"),
    struct.Struct("!Q"),
    struct.Struct("!iQ"),
    0x7FFFFFFF,
)
_connector = ThreadPoolExecutor(8, thread_name_prefix="dock-connect")  # bounded connect + handshake


class Lost(Exception):
    """The peer's process is gone (or never accepted the connection)."""


class NoReply(Exception):
    """The peer did not answer within the timeout."""


class BadMessage(Exception):
    """A message arrived whole but could not be unpickled (the connection is still usable)."""


class BadFrame(Lost):
    """A frame failed authentication (tampered, replayed or out of order); its connection is closed unread."""


class _Channel:
    """One authenticated connection: frames are length | tag | payload, tag = HMAC(session key, direction |
    seq | payload), with a sequence number per direction that both ends count from 0.

    The length prefix is multiprocessing's (so the handshake's Connection and this channel share one
    framing). Frames go out with one scatter-gather send and come in with one read into a buffer of their
    size: a payload is never concatenated, sliced or copied between the pickle and the kernel (a 16 MB frame
    copied five times cost more CPU than its HMAC).
    """

    def __init__(
        self, connection: Connection, key: bytes, send_direction: bytes, recv_direction: bytes
    ) -> None:
        self.connection, self.key = connection, key
        self.send_direction, self.recv_direction = send_direction, recv_direction
        self.sent = self.received = 0
        # A second handle on the same socket (a dup) for sendmsg and recv_into; the Connection keeps poll().
        self._sock = socket.socket(fileno=os.dup(connection.fileno()))

    def _tag(self, direction: bytes, seq: int, payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self.key, direction + seq.to_bytes(8, "big"), hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def send(self, obj: Any) -> None:
        """Pickle `obj` and send it as the next frame."""
        # Plain pickle, not Connection.send: torch registers ForkingPickler reductions that would move tensors
        # into shared memory and pass file descriptors, which only works between related processes.
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        tag = self._tag(self.send_direction, self.sent, payload)
        size = len(tag) + len(payload)
        header = _SIZE.pack(size) if size <= _SIZE_MAX else _LONG_SIZE.pack(-1, size)
        _send_all(self._sock, [memoryview(header), memoryview(tag), memoryview(payload)])
        self.sent += 1

    def recv(self) -> Any:
        """The next frame's object; BadFrame (connection closed) if it is not the next authentic frame."""
        frame = memoryview(_recv_frame(self._sock))  # OSError / EOFError: the connection is gone
        tag, payload = frame[:_TAG_BYTES], frame[_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self.recv_direction, self.received, payload)):
            self.close()
            raise BadFrame(
                f"dock frame #{self.received} failed authentication (tampered, replayed or out of order); "
                "the connection was closed without unpickling it"
            )
        self.received += 1
        try:
            return pickle.loads(payload)
        except Exception as error:  # noqa: BLE001 - e.g. a class the receiver cannot import
            raise BadMessage(f"{type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()
        self.connection.close()


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """sendmsg until every byte of `views` is out (a blocking send may still return early on a signal)."""
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    """Exactly `size` bytes, read straight into one buffer; EOFError if the peer closes first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            raise EOFError("connection closed mid-frame")
        got += count
    return buffer


def _recv_frame(sock: socket.socket) -> bytearray:
    """One frame (multiprocessing's length prefix, then that many bytes)."""
    (size,) = _SIZE.unpack(_recv_exact(sock, _SIZE.size))
    if size == -1:
        (size,) = _LONG.unpack(_recv_exact(sock, _LONG.size))
    return _recv_exact(sock, size)


def _session_key(authkey: bytes, hub_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(authkey, b"dockrl-session" + hub_nonce + client_nonce, hashlib.sha256).digest()


def _hub_channel(connection: Connection, authkey: bytes) -> _Channel:
    """The hub's side of the handshake: challenge both ways, then the nonces (hub's first)."""
    deliver_challenge(connection, authkey)
    answer_challenge(connection, authkey)
    hub_nonce = secrets.token_bytes(_NONCE_BYTES)
    connection.send_bytes(hub_nonce)
    client_nonce = connection.recv_bytes(_NONCE_BYTES)
    return _Channel(connection, _session_key(authkey, hub_nonce, client_nonce), _TO_CLIENT, _TO_HUB)


def _client_channel(address: tuple, authkey: bytes) -> _Channel:
    """Connect to a hub and run the client's side of the handshake."""
    connection = Client(address, authkey=authkey)
    hub_nonce = connection.recv_bytes(_NONCE_BYTES)
    client_nonce = secrets.token_bytes(_NONCE_BYTES)
    connection.send_bytes(client_nonce)
    _tune(connection)
    return _Channel(connection, _session_key(authkey, hub_nonce, client_nonce), _TO_HUB, _TO_CLIENT)


def _shutdown(connection: Connection) -> None:
    """End a connection's pending reads and writes from another thread (its handshake ran out of time)."""
    try:
        with socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def node_ip() -> str:
    """This process's Ray node address (what other nodes reach it at)."""
    import ray

    return ray.util.get_node_ip_address()


def _tune(connection: Connection) -> Connection:
    """No Nagle delay for small messages; keepalive and a user timeout so a vanished peer is noticed."""
    with socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup: same socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data: give up after 30 s (milliseconds)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 30_000)
    return connection


class ServiceHub:
    """Serves `target`'s methods to SocketTransports: one accept thread, one thread per connection.

    Calls from the process that runs the hub skip the socket (see `local`). host None: this Ray node's IP.
    """

    _local: dict[tuple, Any] = {}  # address -> target served in this process

    def __init__(self, target: Any, host: str | None = "127.0.0.1") -> None:
        self.target = target
        self.authkey = secrets.token_bytes(16)
        self._socket = socket.create_server((host or node_ip(), 0), backlog=256)
        self.address = self._socket.getsockname()[:2]
        ServiceHub._local[self.address] = target
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        threading.Thread(target=self._accept, name="dock-hub-accept", daemon=True).start()

    @classmethod
    def local(cls, address: tuple) -> Any:
        """The target served at `address` if its hub runs in this process, else None."""
        return cls._local.get(tuple(address))

    def _accept(self) -> None:
        while not self._closed:
            self._handshakes.acquire()  # released when the connection has authenticated or failed to
            try:
                sock, _ = self._socket.accept()
            except OSError:
                self._handshakes.release()
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(sock,), name="dock-hub", daemon=True).start()

    def _handshake(self, connection: Connection) -> _Channel | None:
        """The channel of an authenticated connection, or None (bad key, or no handshake within
        CONNECT_TIMEOUT_S: the connection is shut down)."""
        watchdog = threading.Timer(CONNECT_TIMEOUT_S, _shutdown, args=(connection,))
        watchdog.daemon = True
        watchdog.start()
        try:
            return _hub_channel(connection, self.authkey)
        except Exception:  # noqa: BLE001 - a failed handshake ends only this connection
            return None
        finally:
            watchdog.cancel()
            self._handshakes.release()

    def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        with Connection(sock.detach()) as connection:
            channel = self._handshake(connection)
            if channel is None:
                return
            _tune(connection)
            try:
                self._answer(channel)
            finally:
                channel.close()  # the channel holds a second handle on the socket: both must close

    def _answer(self, channel: _Channel) -> None:
        """Serve one connection's requests until it closes or sends a frame that fails authentication."""
        while True:
            reply: tuple[str, Any]  # (status, value): "ok" and the result, or "error" and what was raised
            try:
                method, args, kwargs = channel.recv()
            except (EOFError, OSError, BadFrame):  # a bad frame: the channel closed the connection
                return
            except BadMessage as error:
                reply = ("error", TypeError(f"the dock could not unpickle a request: {error}"))
            else:
                try:
                    reply = ("ok", getattr(self.target, method)(*args, **kwargs))
                except Exception as error:  # noqa: BLE001 - sent back and re-raised in the client
                    reply = ("error", error)
            try:
                channel.send(reply)
            except (OSError, ValueError):
                return
            except Exception as error:  # noqa: BLE001 - an unpicklable reply: say so instead
                channel.send(("error", TypeError(f"{method} returned an unpicklable value: {error}")))

    def close(self) -> None:
        """Stop accepting connections (open ones end when their clients go away)."""
        self._closed = True
        ServiceHub._local.pop(self.address, None)
        self._socket.close()


class _Done:
    """A reply already computed (same-process target)."""

    def __init__(self, status: str, value: Any) -> None:
        self.status, self.value = status, value

    def result(self, timeout_s: float) -> Any:
        if self.status == "error":
            raise self.value
        return self.value

    def abandon(self) -> None:
        """Nothing in flight."""


class _SocketPending:
    def __init__(self, transport: SocketTransport, channel: _Channel) -> None:
        self.transport, self.channel = transport, channel

    def result(self, timeout_s: float) -> Any:
        try:
            if not self.channel.connection.poll(max(0.0, timeout_s)):
                self.abandon()  # its late reply must not answer the next request
                raise NoReply()
            status, value = self.channel.recv()
        except BadFrame:
            self.abandon()
            raise
        except (OSError, EOFError) as error:
            self.abandon()
            raise Lost(repr(error)) from error
        if status == "error":
            raise value
        return value

    def abandon(self) -> None:
        """Give up on this reply: close the connection, so the next request opens a fresh one."""
        self.transport._drop(self.channel)


class SocketTransport:
    """Requests to one ServiceHub; one connection per calling thread, made on first use.

    Pickles to its address and key, so it travels inside DockClient to any process.
    """

    def __init__(self, address: tuple, authkey: bytes) -> None:
        self.address, self.authkey = tuple(address), authkey
        self._threads = threading.local()

    def __getstate__(self) -> dict:
        return {"address": self.address, "authkey": self.authkey}

    def __setstate__(self, state: dict) -> None:
        SocketTransport.__init__(self, state["address"], state["authkey"])

    def request(self, method: str, *args, **kwargs) -> _Done | _SocketPending:
        """Send one call; `.result(timeout_s)` waits for its reply (or raises the send's failure),
        `.abandon()` drops it."""
        local = ServiceHub.local(self.address)
        if local is not None:
            try:
                return _Done("ok", getattr(local, method)(*args, **kwargs))
            except Exception as error:  # noqa: BLE001 - raised by result(), like a remote error
                return _Done("error", error)
        channel = getattr(self._threads, "channel", None)
        try:
            if channel is None:
                channel = self._threads.channel = self._connect()
            channel.send((method, args, kwargs))
        except Lost as error:  # no connection could be made
            return _Done("error", error)
        except (OSError, EOFError) as error:
            assert channel is not None  # _connect raises only Lost: this was the send
            self._drop(channel)
            return _Done("error", Lost(repr(error)))
        return _SocketPending(self, channel)

    def call(self, method: str, *args, timeout_s: float, **kwargs) -> Any:
        """request + result."""
        return self.request(method, *args, **kwargs).result(timeout_s)

    def _connect(self) -> _Channel:
        future = _connector.submit(_client_channel, self.address, self.authkey)
        try:
            return future.result(timeout=CONNECT_TIMEOUT_S)
        except FutureTimeout:
            raise Lost(f"no connection to {self.address} within {CONNECT_TIMEOUT_S:g} s") from None
        except Exception as error:  # noqa: BLE001 - refused, reset, failed handshake: the peer is not there
            raise Lost(repr(error)) from error

    def _drop(self, channel: _Channel) -> None:
        if getattr(self._threads, "channel", None) is channel:
            self._threads.channel = None
        try:
            channel.close()
        except OSError:
            pass


class _RayPending:
    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def result(self, timeout_s: float) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(self.ref, timeout=max(0.0, timeout_s))
        except RayActorError as error:
            raise Lost(str(error)) from error
        except GetTimeoutError as error:
            raise NoReply() from error

    def abandon(self) -> None:
        """A Ray reply matches its own ObjectRef: nothing to clean up."""


class RayTransport:
    """Requests as Ray actor calls (`dock.transport: ray`)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def request(self, method: str, *args, **kwargs) -> _RayPending:
        """Submit one actor call; `.result(timeout_s)` waits for it."""
        return _RayPending(getattr(self.actor, method).remote(*args, **kwargs))

    def call(self, method: str, *args, timeout_s: float, **kwargs) -> Any:
        """request + result."""
        return self.request(method, *args, **kwargs).result(timeout_s)
