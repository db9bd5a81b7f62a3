"""WorkerGroup: N Ray actors of one worker class that can form one torch.distributed group.

    driver ── group.call("update", ...) ──▶ rank 0 .. rank N-1   (same method on every rank, in parallel)
           ◀── results, or WorkerError naming the first rank that died / raised / hung

A call waits at most `timeout_s`; a dead actor, an exception in a rank, or a rank still running at the
deadline becomes a `WorkerError` that names the worker (`actor-1 on node 3f2a...`) within that bound,
instead of a silent hang in a collective.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dockrl.parallel.dist import free_port, host_ip, init_distributed


class WorkerError(RuntimeError):
    """A worker died, raised, or did not answer in time; the message names it."""


class Worker:
    """Base class of every worker actor: identity, threads, process-group join."""

    def __init__(self, name: str, rank: int, world_size: int, num_threads: int | None = None):
        import torch

        self.name, self.rank, self.world_size = name, rank, world_size
        if num_threads:
            torch.set_num_threads(num_threads)

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
        import os

        return f"{self.name} on node {ray.get_runtime_context().get_node_id()[:8]} pid {os.getpid()}"


class WorkerGroup:
    """Ray actors of `worker_cls`, one per rank, with named, bounded calls."""

    def __init__(
        self,
        worker_cls: type,
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
    ):
        self.name, self.timeout_s = name, timeout_s
        remote_cls = ray.remote(worker_cls)
        self.names = [f"{name}-{rank}" for rank in range(num_workers)]
        self.actors = [
            remote_cls.options(name=actor_name, num_cpus=num_cpus, num_gpus=num_gpus).remote(
                actor_name, rank, num_workers, **(init_kwargs or {})
            )
            for rank, actor_name in enumerate(self.names)
        ]
        # Starting a worker process (imports, model code) can take far longer than a call on a busy host.
        start_deadline = time.monotonic() + startup_timeout_s
        self._wait([a.where.remote() for a in self.actors], "start", list(range(num_workers)), start_deadline)
        if distributed:
            addr, port = self._wait([self.actors[0].rendezvous.remote()], "rendezvous", [0], start_deadline)[
                0
            ]
            refs = self.call_async("join_group", addr, port, device, timeout_s)
            self.wait(refs, "join_group", start_deadline)

    def __len__(self) -> int:
        return len(self.actors)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Start `method(*args, **kwargs)` on every rank; returns the refs (see `wait`)."""
        return [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank and return the per-rank results."""
        return self.wait(self.call_async(method, *args, **kwargs), method)

    def call_ranks(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        """Run `method` with different positional arguments per rank."""
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return self.wait(refs, method)

    def wait(self, refs: list[ray.ObjectRef], method: str, deadline: float | None = None) -> list[Any]:
        """Gather per-rank results; the first failure (or the deadline) raises a named WorkerError."""
        return self._wait(refs, method, ranks=list(range(len(refs))), deadline=deadline)

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
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, remaining))
            if not done:
                waited = time.monotonic() - started
                names = ", ".join(self.names[ranks[index[r]]] for r in pending)
                raise WorkerError(
                    f"{self.name}.{method}: no answer from {names} after {waited:.0f} s "
                    f"(run.worker_timeout_s); the worker is hung or far slower than expected"
                )
            i = index[done[0]]
            worker = self.names[ranks[i]]
            try:
                results[i] = ray.get(done[0], timeout=max(1.0, deadline - time.monotonic()))
            except RayActorError as exc:
                raise WorkerError(f"{self.name}.{method}: worker {worker} died: {exc}") from exc
            except RayTaskError as exc:
                raise WorkerError(f"{self.name}.{method}: worker {worker} raised:\n{exc}") from exc
            except GetTimeoutError as exc:  # pragma: no cover - ray.wait said it was ready
                raise WorkerError(f"{self.name}.{method}: worker {worker} result not retrievable") from exc
        return results

    def shutdown(self) -> None:
        """Kill the actors (their process groups go with them)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
