"""Supervisor: turns a dead or hung worker or dock actor into a short, named error within seconds.

    driver waits for a stage ──▶ every POLL_S: supervisor.check()
                                   ├─ one heartbeat in flight per watched actor (answered on the actor's own
                                   │  "health" thread, so a busy stage still answers)
                                   ├─ a heartbeat that fails: the actor died          ─▶ WorkerFailure
                                   └─ one unanswered for heartbeat_timeout_s: it hangs ─▶ WorkerFailure

A WorkerFailure names the worker (`actor-1`), its group and rank, its node, the run's step and the stage the
worker was running (its in-flight call, else the driver's current stage), in one line without a Ray
traceback. The recipe then kills every actor of the run (never asks them politely: a polite call would queue
behind a stage blocked in a dock read) and stops, or restarts (run.max_restarts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dockrl.dock.stages import Stage
from dockrl.workers.fault_injection import FaultInjector

POLL_S = 1.0  # how often a waiting driver checks heartbeats, and the longest a death goes unnoticed
HEALTH_GROUP = "health"


class WorkerError(RuntimeError):
    """A worker died, raised, or did not answer in time; the message names it."""


class WorkerFailure(WorkerError):
    """A worker or dock actor died or hung (a failure the run may recover from by restarting).

    Attributes: worker (e.g. "actor-1"), cause ("died", "hung: ..."), where (group, rank, node), step, stage.
    """

    def __init__(self, worker: str, cause: str, where: str, step: int | None, stage: Stage | str | None):
        self.worker, self.cause, self.where, self.step, self.stage = worker, cause, where, step, stage
        at = f" at step {step}" if step is not None else " at start-up"
        super().__init__(f"{worker} ({where}) {cause}{at}, stage {stage or 'none'}")


@dataclass
class _Watched:
    name: str
    handle: Any
    where: str
    method: str
    ping: Any = None  # the heartbeat ObjectRef in flight
    sent: float = 0.0
    in_flight: str | None = None  # the stage method the driver is waiting for on this actor
    stopped: bool = False


@dataclass
class Supervisor:
    """Heartbeats of every actor of one run attempt; `step` and `stage` are set by the recipe.

    stage: where the driver is: a Stage of its own (setup, step, eval, save), or the worker method it last
    started on a group (WorkerGroup sets it: `compute_ref`, `update`, ...; the names fault injection and the
    errors use for a worker's stage).
    """

    heartbeat_timeout_s: float = 30.0
    faults: FaultInjector | None = None
    step: int | None = None
    stage: Stage | str | None = None
    _watched: dict[str, _Watched] = field(default_factory=dict)
    _last_check: float = 0.0

    def watch(
        self,
        name: str,
        handle: Any,
        where: str,
        method: str = "heartbeat",
        pid: int | None = None,
        node_ip: str | None = None,
    ) -> None:
        """Watch actor `handle`, named `name` in errors, described by `where` (group, rank, node);
        `method` answers heartbeats (Worker.heartbeat, or a dock actor's get_incarnation). `pid` and `node_ip`:
        where injected faults reach it."""
        self._watched[name] = _Watched(name, handle, where, method)
        if self.faults is not None and pid is not None:
            self.faults.register(name, pid, node_ip)

    def at(self, stage: Stage | str | None, when: str) -> None:
        """The driver is at `when` (before, during, after, commit) of `stage`: injected faults may fire."""
        if self.faults is not None and stage is not None:
            self.faults.at(stage, self.step, when)

    def unwatch(self, name: str) -> None:
        """Stop watching an actor that is being shut down on purpose."""
        self._watched.pop(name, None)

    def running(self, name: str, method: str | None) -> None:
        """Record the stage method the driver started (None: finished) on actor `name`."""
        if name in self._watched:
            self._watched[name].in_flight = method

    def failure(self, name: str, cause: str) -> WorkerFailure:
        """The error for actor `name` (a death seen by the caller's own wait, for instance)."""
        watched = self._watched.get(name)
        where = watched.where if watched else "starting"
        stage = (watched.in_flight if watched else None) or self.stage
        return WorkerFailure(name, cause, where, self.step, stage)

    def check(self, force: bool = False) -> None:
        """Send due heartbeats and collect answers; raise WorkerFailure for the first dead or hung actor.
        Cheap to call often: it does real work at most every POLL_S unless `force`."""
        now = time.monotonic()
        if not force and now - self._last_check < POLL_S:
            return
        self._last_check = now
        pending = {w.ping: w for w in self._watched.values() if w.ping is not None}
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                watched = pending[ref]
                watched.ping = None
                try:
                    ray.get(ref, timeout=1.0)
                except RayActorError:
                    raise self.failure(watched.name, "died") from None
                except GetTimeoutError:  # pragma: no cover - ray.wait said it was ready
                    pass
        for watched in self._watched.values():
            if watched.ping is None:
                watched.ping, watched.sent = getattr(watched.handle, watched.method).remote(), now
            elif now - watched.sent > self.heartbeat_timeout_s:
                raise self.failure(
                    watched.name,
                    f"hung: no heartbeat for {now - watched.sent:.0f} s (run.heartbeat_timeout_s)",
                )

    def find_dead(self, timeout_s: float = 5.0) -> None:
        """Ping every watched actor afresh and raise WorkerFailure for one that is dead (a dead actor's
        ping fails within moments; live ones answer on their health thread; silence here is not judged)."""
        pings = {getattr(w.handle, w.method).remote(): w for w in self._watched.values()}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref, timeout=1.0)
            except RayActorError:
                raise self.failure(pings[ref].name, "died") from None
            except GetTimeoutError:  # pragma: no cover - ray.wait said it was ready
                pass

    def kill_all(self, wait_s: float = 30.0) -> None:
        """Kill every watched actor at once (nothing is asked politely), then wait (at most `wait_s`) until
        their names are free, so a restart can create actors of the same names."""
        for watched in self._watched.values():
            try:
                ray.kill(watched.handle, no_restart=True)
            except (ValueError, RayActorError):
                pass
        names = list(self._watched)
        self._watched.clear()
        deadline = time.monotonic() + wait_s
        for name in names:
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name)
                except ValueError:  # gone
                    break
                time.sleep(0.05)
