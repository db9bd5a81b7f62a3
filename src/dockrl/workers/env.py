"""The environment tier: environment worker processes that run a multi-turn rollout's environment calls.

```
 rollout head rank (one per tp group)                       EnvWorker x env.num_workers (placement.env)
   TierEnvs.reset(row) ─ least busy worker, sticky per row ─▶  EnvHost: the trajectory's environment, its
   TierEnvs.step(row, message, limit, calls left) ─────────▶      calls env.concurrency at a time, each timed
   TierEnvs.ready(wait) ◀── the outcomes that ended ─────────     from the moment it starts (envs/host.py)
   TierEnvs.drop(row)   ─── the trajectory ended ───────────▶  queued calls cancelled, environment closed
        │
        └─ Lockstep (engines/rollout/multi_turn.py) broadcasts each look's outcomes to the tp peers
```

An agent function (env.name: `./agent.py:solve`, docs/agents.md) runs the same way: the worker hosts the agents
and the OpenAI-compatible server they call (serve/agent_host.py); a call's outcome is the agent's next request.

Environments run in processes of their own, not beside the model: a slow or hostile environment cannot stall
the engine's loop or grow its memory, every call runs once however many tensor-parallel ranks generate, and the
workers may sit on other nodes than the rollout. A worker that dies costs only its trajectories: their calls
answer `error` (env_failed: their groups are dropped or scored 0 under reward.on_error), Ray starts the
process again (max_restarts), and later trajectories go on. A trajectory's first call (reset) that its worker
died under holds nothing there yet: it is sent again once the restarted worker answers a ping (at most
RESET_TRIES times, and within its limit plus HUNG_GRACE_S), so a trajectory that starts while its worker is
being restarted is served, not failed. A worker that stops answering (a call holding the interpreter, a stopped
process) is killed once it has owed an answer for its call limit plus HUNG_GRACE_S and fails a ping, with the
same cost.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dockrl.config.specs import EnvSpec
from dockrl.envs.host import RESET, STEP, EnvHost, Outcome
from dockrl.envs.loader import factory_of, is_agent

HUNG_GRACE_S = 30.0  # past a call's limit, how long a worker may owe answers before it is pinged
PING_S = 5.0  # how long a ping may take before the worker counts as hung
RESET_TRIES = 3  # how often a reset whose worker died under it is sent again to the restarted worker


class EnvWorker:
    """One environment worker process (a Ray actor whose methods run on its event loop): an EnvHost, or for an
    agent function (env.name) an AgentHost (serve/agent_host.py) over the policy's tokenizer at `model_path`."""

    def __init__(self, env: EnvSpec, family: str, model_path: str = ""):
        self.host: Any
        if is_agent(env):  # imported here: an environment's worker never loads the HTTP server
            from dockrl.serve.agent_host import agent_host

            self.host = agent_host(env, model_path)
        else:
            self.host = EnvHost(factory_of(env, family), env.concurrency)

    async def call(
        self, key: str, method: str, argument: Any, limit_s: float, tool_calls_left: int
    ) -> Outcome:
        """One environment call of trajectory `key` (envs/host.py EnvHost.submit)."""
        return await asyncio.wrap_future(self.host.submit(key, method, argument, limit_s, tool_calls_left))

    async def drop(self, key: str) -> None:
        """Trajectory `key` ended (EnvHost.drop)."""
        self.host.drop(key)

    async def ping(self) -> int:
        """This worker's process id: it answers."""
        return os.getpid()

    async def counts(self) -> dict[str, int]:
        """The host's call counters (calls, timeouts, cancelled, errors, abandoned_threads)."""
        return dict(self.host.counts)


def start_env_workers(env: EnvSpec, family: str, resources: list[str], model_path: str = "") -> list[Any]:
    """env.num_workers EnvWorker actors: no CPU reserved, restarted when they die, each on the node offering
    its entry of `resources` (placement.env, cycled; empty: anywhere)."""
    remote = ray.remote(EnvWorker)
    workers = []
    for i in range(env.num_workers):
        options: dict[str, Any] = dict(
            num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=10_000
        )
        if resources:
            options["resources"] = {resources[i % len(resources)]: 0.001}
        workers.append(remote.options(**options).remote(env, family, model_path))
    return workers


def tier_envs(workers: list[Any] | None, name: str) -> TierEnvs | None:
    """EnvCalls over the run's environment workers for one rollout pass of worker `name`; None without them."""
    return TierEnvs(workers, name) if workers else None


@dataclass(frozen=True)
class _Call:
    """One environment call the tier sent: what to send again should its worker die under a reset."""

    row: int
    worker: int
    method: str
    argument: Any
    limit_s: float
    tool_calls_left: int
    tries: int = 0


class TierEnvs:
    """EnvCalls (envs/host.py) over environment workers: each trajectory stays on the worker that reset it."""

    def __init__(
        self, workers: list[Any], name: str, hung_grace_s: float = HUNG_GRACE_S, ping_s: float = PING_S
    ):
        assert workers, "the environment tier has at least one worker"
        self.workers, self.hung_grace_s, self.ping_s = workers, hung_grace_s, ping_s
        self.prefix = f"{name}-{uuid.uuid4().hex[:8]}"
        self.home: dict[int, int] = {}  # row -> worker index
        self.running: dict[Any, _Call] = {}  # call ref -> the call
        # ping ref -> the reset to send again once the ping answers, and its deadline
        self.reviving: dict[Any, tuple[_Call, float]] = {}
        self.owed_since: dict[int, float] = {}  # worker -> when it last answered while owing
        self.order = itertools.count()

    def reset(self, row: int, env_row: dict[str, Any], limit_s: float) -> None:
        busy = [0] * len(self.workers)
        for call in self.running.values():
            busy[call.worker] += 1
        start, n = next(self.order), len(self.workers)
        self.home[row] = min(((start + i) % n for i in range(n)), key=lambda w: busy[w])  # ties: round robin
        self._send(_Call(row, self.home[row], RESET, env_row, limit_s, 0))

    def step(self, row: int, message: str, limit_s: float, tool_calls_left: int) -> None:
        self._send(_Call(row, self.home[row], STEP, message, limit_s, tool_calls_left))

    def drop(self, row: int) -> None:
        for ref, (call, _) in list(self.reviving.items()):
            if call.row == row:
                del self.reviving[ref]
        worker = self.home.pop(row, None)
        if worker is not None:
            self.workers[worker].drop.remote(self._key(row))

    def ready(self, wait_s: float) -> list[tuple[int, Outcome]]:
        if not self.running and not self.reviving:
            return []
        refs = [*self.running, *self.reviving]
        done, _ = ray.wait(refs, num_returns=1, timeout=wait_s)
        if done:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        got = []
        for ref in done:
            if ref in self.reviving:
                got.extend(self._revived(ref))
                continue
            call = self.running[ref]
            outcome, died = self._outcome(ref)
            if died and call.method == RESET and call.tries < RESET_TRIES:
                self._revive(call)
            else:
                got.append((call.row, outcome))
        got.extend(self._expired())
        if not done and wait_s > 0:
            self._check_hung()
        return got

    def close(self) -> None:
        for row in list(self.home):
            self.drop(row)

    # ---- inside -----------------------------------------------------------------------------------

    def _key(self, row: int) -> str:
        return f"{self.prefix}-{row}"

    def _send(self, call: _Call) -> None:
        ref = self.workers[call.worker].call.remote(
            self._key(call.row), call.method, call.argument, call.limit_s, call.tool_calls_left
        )
        self.running[ref] = call
        self.owed_since.setdefault(call.worker, time.monotonic())

    def _outcome(self, ref: Any) -> tuple[Outcome, bool]:
        """The call's outcome, and whether its worker died under it (an actor error)."""
        worker = self.running.pop(ref).worker
        if any(c.worker == worker for c in self.running.values()):
            self.owed_since[worker] = time.monotonic()
        else:
            self.owed_since.pop(worker, None)
        try:
            return ray.get(ref), False
        except (RayActorError, RayTaskError) as exc:
            return self._failed(worker, type(exc).__name__), isinstance(exc, RayActorError)

    @staticmethod
    def _failed(worker: int, what: str) -> Outcome:
        return Outcome("error", error=f"environment worker {worker} failed: {what}")

    def _revive(self, call: _Call) -> None:
        """Send reset `call` again once its worker, started again by Ray, answers a ping (the ping is retried
        by Ray through the restart; the reset itself is not: an environment whose reset kills its worker
        fails after RESET_TRIES restarts)."""
        ping = self.workers[call.worker].ping.options(max_task_retries=-1).remote()
        deadline = time.monotonic() + call.limit_s + self.hung_grace_s
        self.reviving[ping] = (replace(call, tries=call.tries + 1), deadline)

    def _revived(self, ping: Any) -> list[tuple[int, Outcome]]:
        call, _ = self.reviving.pop(ping)
        try:
            ray.get(ping)
        except RayActorError as exc:  # the worker is gone for good
            return [(call.row, self._failed(call.worker, type(exc).__name__))]
        self._send(call)
        return []

    def _expired(self) -> list[tuple[int, Outcome]]:
        """Resets whose worker did not come back within their limit plus the grace: they fail."""
        now = time.monotonic()
        late = [ref for ref, (_, deadline) in self.reviving.items() if now > deadline]
        return [
            (call.row, self._failed(call.worker, "not started again"))
            for call, _ in map(self.reviving.pop, late)
        ]

    def _check_hung(self) -> None:
        """Kill (and so restart) a worker that owes answers past its calls' limits and does not answer a ping:
        its calls then fail as a dead worker's do."""
        now = time.monotonic()
        for worker, since in list(self.owed_since.items()):
            limit = max((c.limit_s for c in self.running.values() if c.worker == worker), default=0.0)
            if now - since < limit + self.hung_grace_s:
                continue
            try:
                ray.get(self.workers[worker].ping.remote(), timeout=self.ping_s)
                self.owed_since[worker] = now  # it answers: its calls are queued behind others
            except (GetTimeoutError, RayActorError):
                ray.kill(self.workers[worker], no_restart=False)
                self.owed_since[worker] = now
                for ref, call in self.running.items():  # a reset that hung its worker is not sent again
                    if call.worker == worker:
                        self.running[ref] = replace(call, tries=RESET_TRIES)
