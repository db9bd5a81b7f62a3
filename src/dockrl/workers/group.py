"""WorkerGroup: N Ray actors of one worker class that can form one torch.distributed group.

    driver ── actors.update() ──▶ rank 0 .. rank N-1   (ActorWorker.update on every rank, in parallel)
           ◀── results, or WorkerError naming the first rank that died / raised / hung

A call waits at most `timeout_s`; a dead actor, an exception in a rank, or a rank still running at the
deadline becomes a `WorkerError` that names the worker (`actor-1 on node 3f2a...`) within that bound,
instead of a silent hang in a collective. With a `Supervisor` (workers/supervisor.py) the wait also checks the
heartbeats of every actor of the run, so a worker of another group that dies or hangs meanwhile stops the
wait within seconds as a `WorkerFailure`.

Every worker answers `heartbeat` on its own "health" thread (a Ray concurrency group), so a stage that runs
for minutes does not look hung; stage methods still run one at a time.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dockrl.checkpoint.shared_dir import Probe, check_probe
from dockrl.dock.choice import DockChoice
from dockrl.dock.remote import remote_class
from dockrl.parallel.dist import free_port, host_ip, init_distributed
from dockrl.workers.fault_injection import process_identity
from dockrl.workers.supervisor import HEALTH_GROUP, POLL_S, Supervisor, WorkerError, WorkerFailure

__all__ = ["Pending", "Worker", "WorkerError", "WorkerFailure", "WorkerGroup"]

T = TypeVar("T")
PLACEMENT_SHARE = 0.001  # of a node's custom placement resource one rank takes: any number of ranks fit


class Worker:
    """Base class of every worker actor: identity, threads, process-group join."""

    threads: dict[str, int] = {}  # concurrency groups of its own beside the health thread (name -> threads)

    def __init__(self, name: str, rank: int, world_size: int, num_threads: int | None = None):
        import torch

        self.name, self.rank, self.world_size = name, rank, world_size
        if num_threads:
            torch.set_num_threads(num_threads)

    client: DockChoice  # set by the subclasses that use the dock

    def select_dock(self, index: int) -> None:
        """Asynchronous runs: point this worker's dock client at dock `index` (see dock/choice.py)."""
        self.client.select(index)

    def rendezvous(self) -> tuple[str, int]:
        """Address and a free port on this worker's host (called on rank 0)."""
        return host_ip(), free_port()

    def join_group(self, master_addr: str, master_port: int, device: str, timeout_s: float) -> str:
        """Join the group's torch.distributed process group."""
        self.device = init_distributed(
            self.rank, self.world_size, master_addr, master_port, device, timeout_s
        )
        return str(self.device)

    def where(self) -> str:
        """`name on node <id> pid <pid>` for error messages."""
        return f"{self.name} on node {ray.get_runtime_context().get_node_id()[:8]} pid {os.getpid()}"

    def identity(self) -> dict[str, Any]:
        """Node address and id, and process id, for naming this worker in errors."""
        return process_identity()

    def check_output_dir(self, probe: Probe) -> None:
        """Raise unless this worker's node sees the driver's run.output_dir (checkpoint/shared_dir.py)."""
        check_probe(probe, node=f"{socket.gethostname()} ({process_identity()['node_ip']})")

    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self) -> float:
        """Answered on the health thread, even while a stage runs (see the module docstring)."""
        return time.time()


@dataclass
class Pending(Generic[T]):
    """A stage started on every rank of a group; `wait()` returns one result per rank, in rank order, or
    raises a WorkerError naming the first rank that died, raised or hung."""

    group: WorkerGroup
    method: str
    refs: list

    def wait(self) -> list[T]:
        """Block for every rank's result (bounded by the group's timeout and the supervisor)."""
        return self.group.wait(self.refs, self.method)


class WorkerGroup:
    """Ray actors of `worker_cls`, one per rank, with named, bounded calls (`worker`: the worker class of a
    typed subclass, e.g. ActorGroup).

    Stages start typed: `group.start(ActorWorker.update)` runs that method on every rank and returns a
    `Pending[UpdateResult]` (the worker classes' groups wrap this as `actors.update()`); `call`/`call_async`
    take a method name, for generic tools and tests (recipes call the typed methods only)."""

    worker: type[Worker] | None = None

    def __init__(
        self,
        worker_cls: type[Worker],
        num_workers: int,
        *,
        name: str,
        init_kwargs: dict[str, Any] | None = None,
        num_cpus: float = 0,
        num_gpus: float = 0,
        timeout_s: float = 1800.0,
        distributed: bool = False,
        device: str = "cpu",
        startup_timeout_s: float = 300.0,
        supervisor: Supervisor | None = None,
        wait: bool = True,
        node_resources: list[str] | None = None,
    ):
        self.name, self.timeout_s, self.supervisor = name, timeout_s, supervisor
        # ray.remote's typed overloads omit concurrency_groups, which it takes (an actor option).
        groups = {HEALTH_GROUP: 1, **worker_cls.threads}
        remote_cls = remote_class(worker_cls, tuple(sorted(groups.items())))
        self.names = [f"{name}-{rank}" for rank in range(num_workers)]

        def placed(rank: int) -> dict[str, float]:  # rank i on a node offering node_resources[i mod len]
            return {node_resources[rank % len(node_resources)]: PLACEMENT_SHARE} if node_resources else {}

        self.actors = [
            remote_cls.options(
                name=actor_name, num_cpus=num_cpus, num_gpus=num_gpus, resources=placed(rank)
            ).remote(actor_name, rank, num_workers, **(init_kwargs or {}))
            for rank, actor_name in enumerate(self.names)
        ]
        # Starting a worker process (imports, model code) can take far longer than a call on a busy host.
        deadline = time.monotonic() + startup_timeout_s
        self._pending_start: tuple[bool, str, float] | None = (distributed, device, deadline)
        self._identity_refs = [a.identity.remote() for a in self.actors]
        if wait:
            self.wait_started()

    def wait_started(self) -> WorkerGroup:
        """Wait until every actor runs (naming each to the supervisor) and the process group is joined.
        Groups made with wait=False start side by side; call this on each before using it."""
        if self._pending_start is None:
            return self
        distributed, device, deadline = self._pending_start
        try:
            self._start(self.supervisor, distributed, device, deadline)
        except BaseException:
            self.shutdown()  # never leave half a group running
            raise
        self._pending_start = None
        return self

    def _start(self, supervisor: Supervisor | None, distributed: bool, device: str, deadline: float) -> None:
        ids = self._wait(self._identity_refs, "start", list(range(len(self))), deadline)
        self.identities = ids
        if supervisor is not None:
            for rank, (actor, ident) in enumerate(zip(self.actors, ids)):
                where = f"{self.name} rank {rank}, node {ident['node_ip']} {ident['node_id'][:8]}, pid {ident['pid']}"
                supervisor.watch(self.names[rank], actor, where, pid=ident["pid"], node_ip=ident["node_ip"])
        if distributed:
            addr, port = self._wait([self.actors[0].rendezvous.remote()], "rendezvous", [0], deadline)[0]
            joining = self.start(Worker.join_group, addr, port, device, self.timeout_s)
            self.wait(joining.refs, joining.method, deadline)

    def __len__(self) -> int:
        return len(self.actors)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Start `method(*args, **kwargs)` on every rank; returns the refs (see `wait`)."""
        self._running(method)
        refs = [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]
        self._at(method, "during")
        return refs

    def _running(self, method: str) -> None:
        if self.supervisor is not None:
            self.supervisor.stage = method  # the driver's latest stage, named when a dock actor fails
            self.supervisor.at(method, "before")
            for name in self.names:
                self.supervisor.running(name, method)

    def _at(self, method: str, when: str) -> None:
        if self.supervisor is not None:
            self.supervisor.at(method, when)

    def start(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> Pending[T]:
        """Start worker method `method` (a function of the worker class, e.g. ActorWorker.update) on every rank."""
        return Pending(self, method.__name__, self.call_async(method.__name__, *args, **kwargs))

    def check_output_dir(self, probe: Probe) -> Pending[None]:
        """Every rank checks that its node sees the driver's run.output_dir (the probe file)."""
        return self.start(Worker.check_output_dir, probe)

    def start_ranks(self, method: Callable[..., T], per_rank_args: list[tuple]) -> Pending[T]:
        """Start `method` with different positional arguments per rank."""
        name = method.__name__
        self._running(name)
        refs = [getattr(a, name).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        self._at(name, "during")
        return Pending(self, name, refs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank and return the per-rank results."""
        return self.wait(self.call_async(method, *args, **kwargs), method)

    def wait(self, refs: list[ray.ObjectRef], method: str, deadline: float | None = None) -> list[Any]:
        """Gather per-rank results; the first failure (or the deadline) raises a named WorkerError."""
        results = self._wait(refs, method, ranks=list(range(len(refs))), deadline=deadline)
        self._at(method, "after")
        return results

    def _wait(
        self, refs: list[ray.ObjectRef], method: str, ranks: list[int], deadline: float | None = None
    ) -> list[Any]:
        started = time.monotonic()
        deadline = deadline or started + self.timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waited = time.monotonic() - started
                names = ", ".join(self.names[ranks[index[r]]] for r in pending)
                if self.supervisor is not None:  # alive but stuck: a hang the run may recover from
                    stuck = self.names[ranks[index[pending[0]]]]
                    cause = (
                        f"hung: {method} still running after {waited:.0f} s (run.worker_timeout_s; {names})"
                    )
                    raise self.supervisor.failure(stuck, cause)
                raise WorkerError(
                    f"{self.name}.{method}: no answer from {names} after {waited:.0f} s "
                    f"(run.worker_timeout_s); the worker is hung or far slower than expected"
                )
            slice_s = remaining if self.supervisor is None else min(remaining, POLL_S)
            done, pending = ray.wait(pending, num_returns=1, timeout=slice_s)
            if self.supervisor is not None:
                self.supervisor.check()  # at most every POLL_S: a death elsewhere ends this wait too
            if not done:
                continue
            i = index[done[0]]
            worker = self.names[ranks[i]]
            try:
                results[i] = ray.get(done[0], timeout=max(1.0, deadline - time.monotonic()))
            except RayActorError as exc:
                if self.supervisor is not None:
                    raise self.supervisor.failure(worker, "died") from exc
                raise WorkerError(f"{self.name}.{method}: worker {worker} died") from exc
            except RayTaskError as exc:
                raised = exc.cause if getattr(exc, "cause", None) is not None else exc
                error = WorkerError(
                    f"{self.name}.{method}: worker {worker} raised: {type(raised).__name__}: {raised}"
                )
                # Read back with getattr (recipes/grpo.py); WorkerError (supervisor.py) does not declare it.
                error.remote_traceback = str(exc)  # type: ignore[attr-defined]
                raise error from None
            except GetTimeoutError as exc:  # pragma: no cover - ray.wait said it was ready
                raise WorkerError(f"{self.name}.{method}: worker {worker} result not retrievable") from exc
            if self.supervisor is not None:
                self.supervisor.running(worker, None)
        return results

    def select_dock(self, dock: int) -> None:
        """Asynchronous runs: every rank's dock client reads and writes dock `dock` from now on (a DockChoice).
        Waits until every rank has switched: a rank still running a stage (a generation of another dock)
        switches when that stage ends, since a worker runs its stage methods one at a time."""
        self.start(Worker.select_dock, dock).wait()

    def shutdown(self) -> None:
        """Kill the actors (their process groups go with them)."""
        for name, actor in zip(self.names, self.actors):
            if self.supervisor is not None:
                self.supervisor.unwatch(name)
            try:
                ray.kill(actor, no_restart=True)
            except (ValueError, RayActorError):  # already gone
                pass
        self.actors = []
