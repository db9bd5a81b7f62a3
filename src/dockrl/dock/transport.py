"""How dock clients reach the controller and the warehouses: direct sockets (default) or Ray actor calls.

```
 socket:  client thread ──own TCP connection──▶ ServiceHub thread in the actor's process ──▶ method
 ray:     client ──actor.method.remote()──▶ Ray core worker ──▶ method   (payload through the object store)
```

Both give `request(method, *args, **kwargs) -> Pending` and `Pending.result(timeout_s)`, so a client sends
to every warehouse first and then collects the replies (the calls overlap). Failures come out as two
exceptions the client turns into errors that name the actor and the rows: `Lost` (the peer's process is
gone: connection refused/reset/closed, or RayActorError) and `NoReply` (no answer within the timeout).

Why sockets: a Ray actor call costs ~1-2 ms of scheduling and object-store work here, and payloads over
100 KB detour through the object store; a direct connection costs one pickle and one send. The actors stay
Ray actors (placement, lifecycle, names, incarnations); only the request path changes. A hub serves each
connection on its own thread, so the target must be thread-safe (Warehouse and SharedController are).
No Ray import here: the central modes (driver hub) use the same hub.
"""

from __future__ import annotations

import pickle
import secrets
import socket
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any


def _send(connection: Connection, obj: Any) -> None:
    # Plain pickle, not Connection.send: torch registers ForkingPickler reductions that would move tensors
    # into shared memory and pass file descriptors, which only works between related processes.
    connection.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(connection: Connection) -> Any:
    return pickle.loads(connection.recv_bytes())


def _no_delay(connection: Connection) -> Connection:
    """Send small messages at once (no Nagle wait for the ACK of the previous segment)."""
    with socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup: same socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


class Lost(Exception):
    """The peer's process is gone (or never accepted the connection)."""


class NoReply(Exception):
    """The peer did not answer within the timeout."""


class ServiceHub:
    """Serves `target`'s methods to SocketTransports: one accept thread, one thread per connection.

    Calls from the process that runs the hub skip the socket (see `local`).
    """

    _local: dict[tuple, Any] = {}  # address -> target served in this process

    def __init__(self, target: Any, host: str = "127.0.0.1") -> None:
        self.target = target
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener((host, 0), backlog=256, authkey=self.authkey)
        self.address = self._listener.address
        ServiceHub._local[self.address] = target
        self._closed = False
        threading.Thread(target=self._accept, name="dock-hub-accept", daemon=True).start()

    @classmethod
    def local(cls, address: tuple) -> Any:
        """The target served at `address` if its hub runs in this process, else None."""
        return cls._local.get(address)

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection = self._listener.accept()
            except Exception:  # noqa: BLE001 - a failed handshake must not stop the hub
                if self._closed:
                    return
                continue
            threading.Thread(
                target=self._serve, args=(_no_delay(connection),), name="dock-hub", daemon=True
            ).start()

    def _serve(self, connection: Connection) -> None:
        with connection:
            while True:
                try:
                    method, args, kwargs = _recv(connection)
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", getattr(self.target, method)(*args, **kwargs))
                except Exception as error:  # noqa: BLE001 - sent back and re-raised in the client
                    reply = ("error", error)
                try:
                    _send(connection, reply)
                except (OSError, ValueError):
                    return
                except Exception as error:  # noqa: BLE001 - an unpicklable reply: say so instead
                    _send(
                        connection, ("error", TypeError(f"{method} returned an unpicklable value: {error}"))
                    )

    def close(self) -> None:
        """Stop accepting connections (open ones end when their clients go away)."""
        self._closed = True
        ServiceHub._local.pop(self.address, None)
        self._listener.close()


class _Done:
    """A reply already computed (same-process target)."""

    def __init__(self, status: str, value: Any) -> None:
        self.status, self.value = status, value

    def result(self, timeout_s: float) -> Any:
        if self.status == "error":
            raise self.value
        return self.value


class _SocketPending:
    def __init__(self, transport: SocketTransport, connection: Connection) -> None:
        self.transport, self.connection = transport, connection

    def result(self, timeout_s: float) -> Any:
        try:
            if not self.connection.poll(max(0.0, timeout_s)):
                self.transport._drop(self.connection)  # its late reply must not answer the next request
                raise NoReply()
            status, value = _recv(self.connection)
        except (OSError, EOFError) as error:
            self.transport._drop(self.connection)
            raise Lost(repr(error)) from error
        if status == "error":
            raise value
        return value


class SocketTransport:
    """Requests to one ServiceHub; one connection per calling thread, made on first use.

    Pickles to its address and key, so it travels inside DockClient to any process.
    """

    def __init__(self, address: tuple, authkey: bytes) -> None:
        self.address, self.authkey = address, authkey
        self._threads = threading.local()

    def __getstate__(self) -> dict:
        return {"address": self.address, "authkey": self.authkey}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"], state["authkey"])

    def request(self, method: str, *args, **kwargs) -> _Done | _SocketPending:
        """Send one call; `.result(timeout_s)` waits for its reply."""
        local = ServiceHub.local(self.address)
        if local is not None:
            try:
                return _Done("ok", getattr(local, method)(*args, **kwargs))
            except Exception as error:  # noqa: BLE001 - raised by result(), like a remote error
                return _Done("error", error)
        connection = getattr(self._threads, "connection", None)
        try:
            if connection is None:
                connection = _no_delay(Client(self.address, authkey=self.authkey))
                self._threads.connection = connection
            _send(connection, (method, args, kwargs))
        except (OSError, EOFError) as error:
            if connection is not None:
                self._drop(connection)
            raise Lost(repr(error)) from error
        return _SocketPending(self, connection)

    def call(self, method: str, *args, timeout_s: float, **kwargs) -> Any:
        """request + result."""
        return self.request(method, *args, **kwargs).result(timeout_s)

    def _drop(self, connection: Connection) -> None:
        if getattr(self._threads, "connection", None) is connection:
            self._threads.connection = None
        try:
            connection.close()
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
