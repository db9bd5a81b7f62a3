"""EnvHost: the environments of many trajectories in one process, their calls timed from the moment they start.

```
 submit(key, RESET, row, limit) / submit(key, STEP, message, limit, tool_calls_left) ─▶ Future[Outcome]
     queued until one of `concurrency` threads is free (an `async def` method: on the host's event loop)
     the call starts ─▶ its deadline is now + limit; the environment reads time_left() and tool_calls_left()
         returns in time      ─▶ Outcome("ok", observation, seconds)
         raises               ─▶ Outcome("error", error=...)
         runs past deadline   ─▶ Outcome("timeout") at the deadline; a sync call's thread runs on, abandoned
                                 (a daemon: it holds neither the pool nor the process's exit), and a fresh
                                 thread takes its place; a coroutine is cancelled
 drop(key) ─▶ the trajectory gave up: its queued calls answer Outcome("cancelled") without running, its
     environment is closed (its `close()`, if it has one) and forgotten
```

One host serves a rollout in-process (held-out evaluation, tests, `LocalEnvs`) or runs inside an environment
worker process (workers/env.py), where the rollout's head rank drives it. Keys are the caller's: one per
trajectory, unique for the host's lifetime. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from dockrl.envs.base import CallBudget, Environment, ModelRequest, Observation, current_budget

RESET, STEP = "reset", "step"
OutcomeKind = Literal["ok", "error", "timeout", "cancelled"]


@dataclass(frozen=True)
class Outcome:
    """How one environment call ended: its observation ("ok"; an agent function's host answers with the agent's
    next ModelRequest, or an Observation with done=True when it returned), or why not; `seconds` it ran (0 if it
    never started)."""

    kind: OutcomeKind
    observation: Observation | ModelRequest | None = None
    error: str = ""
    seconds: float = 0.0


class _Slot:
    """One trajectory's environment (built by its reset call) and whether the trajectory gave up."""

    def __init__(self) -> None:
        self.env: Environment | None = None
        self.dropped = False


@dataclass
class _Call:
    slot: _Slot
    method: str
    argument: Any
    limit_s: float
    tool_calls_left: int
    future: Future
    started: float = 0.0
    thread: int = 0  # the thread running it


class EnvHost:
    """Environments built by `factory` (one per trajectory), their calls run `concurrency` at a time (module
    docstring)."""

    def __init__(self, factory: Callable[[], Environment], concurrency: int):
        self.factory = factory
        probe = factory()  # what kind of methods the environment has (a bad factory fails here)
        self.is_async = {m: inspect.iscoroutinefunction(getattr(probe, m)) for m in (RESET, STEP)}
        _close(probe)
        self.slots: dict[str, _Slot] = {}
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.num_threads = 0
        self.abandoned: set[int] = set()  # thread idents whose call timed out: they exit when it returns
        self.counts = {"calls": 0, "timeouts": 0, "cancelled": 0, "errors": 0, "abandoned_threads": 0}
        self._watch = _Watchdog(self._expire)
        self._loop: asyncio.AbstractEventLoop | None = None
        for _ in range(max(1, concurrency)):
            self._add_thread()

    # ---- the caller's side ------------------------------------------------------------------------

    def submit(
        self, key: str, method: str, argument: Any, limit_s: float, tool_calls_left: int = 1 << 30
    ) -> Future:
        """Queue `method` (RESET with the dataset row, STEP with the assistant message) for trajectory `key`;
        the future's result is its Outcome. A RESET builds the trajectory's environment."""
        assert method in (RESET, STEP), method
        with self.lock:
            slot = self.slots.setdefault(key, _Slot()) if method == RESET else self.slots.get(key)
        future: Future = Future()
        if slot is None:
            future.set_result(Outcome("error", error=f"no environment for trajectory {key!r} on this host"))
            return future
        call = _Call(slot, method, argument, limit_s, tool_calls_left, future)
        if self.is_async[method]:
            asyncio.run_coroutine_threadsafe(self._run_async(call), self._event_loop())
        else:
            self.calls.put(call)
        return future

    def drop(self, key: str) -> None:
        """Trajectory `key` ended: cancel its queued calls, close and forget its environment."""
        with self.lock:
            slot = self.slots.pop(key, None)
        if slot is not None:
            slot.dropped = True
            if slot.env is not None:
                self.calls.put(_Call(slot, "close", None, 0.0, 0, Future()))

    def close(self) -> None:
        """Stop the threads (calls running past their deadline are not waited for)."""
        with self.lock:
            threads = self.num_threads
        for _ in range(threads):
            self.calls.put(None)
        self._watch.stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    # ---- the threads ------------------------------------------------------------------------------

    def _add_thread(self) -> None:
        with self.lock:
            self.num_threads += 1
        threading.Thread(target=self._serve, name="dockrl-env", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call = self.calls.get()
            if call is None:
                return
            self._run(call)
            if threading.get_ident() in self.abandoned:  # its call timed out; a fresh thread took its place
                with self.lock:
                    self.abandoned.discard(threading.get_ident())
                return

    def _run(self, call: _Call) -> None:
        if call.method == "close":
            _close(call.slot.env)
            return
        if call.slot.dropped:
            self._answer(call, Outcome("cancelled"))
            return
        call.started = time.perf_counter()
        call.thread = threading.get_ident()
        self._watch.add(call.started + call.limit_s, call)
        token = current_budget.set(CallBudget(time.monotonic() + call.limit_s, call.tool_calls_left))
        try:
            if call.method == RESET:
                call.slot.env = self.factory()
            observation = getattr(call.slot.env, call.method)(call.argument)
        except Exception as exc:  # the environment's failure ends its trajectory, never the host
            self._answer(
                call, Outcome("error", error=f"{type(exc).__name__}: {exc}", seconds=self._since(call))
            )
        else:
            self._answer(call, Outcome("ok", observation, seconds=self._since(call)))
        finally:
            current_budget.reset(token)

    def _expire(self, call: _Call) -> None:
        """The watchdog's call at a deadline: answer `timeout` unless the call already returned, and replace
        its thread."""
        if self._answer(call, Outcome("timeout", seconds=call.limit_s)):
            with self.lock:
                self.abandoned.add(call.thread)
                self.counts["abandoned_threads"] += 1
                self.num_threads -= 1
            self._add_thread()

    # ---- coroutines -------------------------------------------------------------------------------

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="dockrl-env-loop", daemon=True).start()
            return self._loop

    async def _run_async(self, call: _Call) -> None:
        if call.slot.dropped:
            self._answer(call, Outcome("cancelled"))
            return
        call.started = time.perf_counter()
        current_budget.set(CallBudget(time.monotonic() + call.limit_s, call.tool_calls_left))
        try:
            if call.method == RESET:
                call.slot.env = self.factory()
            method = getattr(call.slot.env, call.method)
            observation = await asyncio.wait_for(method(call.argument), call.limit_s)
        except TimeoutError:
            self._answer(call, Outcome("timeout", seconds=call.limit_s))
        except Exception as exc:  # as in _run
            self._answer(
                call, Outcome("error", error=f"{type(exc).__name__}: {exc}", seconds=self._since(call))
            )
        else:
            self._answer(call, Outcome("ok", observation, seconds=self._since(call)))

    # ---- both -------------------------------------------------------------------------------------

    def _answer(self, call: _Call, outcome: Outcome) -> bool:
        """Set the call's outcome unless it has one (a call that returns after its timeout was answered);
        True when this one counted."""
        try:
            call.future.set_result(outcome)
        except InvalidStateError:
            return False
        with self.lock:
            self.counts["calls"] += 1
            for kind, counter in (("timeout", "timeouts"), ("cancelled", "cancelled"), ("error", "errors")):
                self.counts[counter] += int(outcome.kind == kind)
        return True

    @staticmethod
    def _since(call: _Call) -> float:
        return time.perf_counter() - call.started


def _close(env: Any) -> None:
    """An environment's `close()`, when it has one (its failure is its own)."""
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # a failing close must not take a host thread down
            pass


class _Watchdog:
    """One thread that calls `expire(call)` at each call's deadline (perf_counter seconds)."""

    def __init__(self, expire: Callable[[_Call], None]):
        self.expire = expire
        self.heap: list[tuple[float, int, _Call]] = []
        self.order = itertools.count()
        self.wake = threading.Condition()
        self.stopped = False
        threading.Thread(target=self._watch, name="dockrl-env-watchdog", daemon=True).start()

    def add(self, deadline: float, call: _Call) -> None:
        with self.wake:
            heapq.heappush(self.heap, (deadline, next(self.order), call))
            self.wake.notify()

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()

    def _watch(self) -> None:
        while True:
            with self.wake:
                while not self.stopped and (not self.heap or self.heap[0][0] > time.perf_counter()):
                    timeout = self.heap[0][0] - time.perf_counter() if self.heap else None
                    self.wake.wait(timeout)
                if self.stopped:
                    return
                _, _, call = heapq.heappop(self.heap)
            if not call.future.done():
                self.expire(call)


class EnvCalls(Protocol):
    """What a multi-turn rollout asks of its environments, keyed by row: calls go out, outcomes come back."""

    def reset(self, row: int, env_row: dict[str, Any], limit_s: float) -> None:
        """Build row `row`'s environment and reset it with the dataset row."""
        ...

    def step(self, row: int, message: Any, limit_s: float, tool_calls_left: int) -> None:
        """Answer the trajectory's assistant message (its text; to an agent: its Sampled tokens)."""
        ...

    def drop(self, row: int) -> None:
        """The trajectory ended: its environment goes, its queued calls never run."""
        ...

    def ready(self, wait_s: float) -> list[tuple[int, Outcome]]:
        """The calls that ended since the last look, waiting up to `wait_s` for the first."""
        ...

    def close(self) -> None:
        """The rollout is done with these environments."""
        ...


class CallHost(Protocol):
    """What runs a trajectory's calls: an EnvHost, or an agent function's host (serve/agent_host.py AgentHost)."""

    def submit(
        self, key: str, method: str, argument: Any, limit_s: float, tool_calls_left: int = 1 << 30
    ) -> Future: ...

    def drop(self, key: str) -> None: ...

    def close(self) -> None: ...


class LocalEnvs:
    """EnvCalls on an EnvHost (or an AgentHost) in this process (held-out evaluation, tests, benches)."""

    def __init__(self, host: CallHost):
        self.host, self.prefix = host, f"local-{next(_SERVES)}"
        self.running: dict[Future, int] = {}

    def reset(self, row: int, env_row: dict[str, Any], limit_s: float) -> None:
        self.running[self.host.submit(f"{self.prefix}-{row}", RESET, env_row, limit_s)] = row

    def step(self, row: int, message: Any, limit_s: float, tool_calls_left: int) -> None:
        future = self.host.submit(f"{self.prefix}-{row}", STEP, message, limit_s, tool_calls_left)
        self.running[future] = row

    def drop(self, row: int) -> None:
        self.host.drop(f"{self.prefix}-{row}")

    def ready(self, wait_s: float) -> list[tuple[int, Outcome]]:
        if not self.running:
            return []
        done, _ = wait(list(self.running), timeout=wait_s, return_when=FIRST_COMPLETED)
        return [(self.running.pop(future), future.result()) for future in done]

    def close(self) -> None:
        self.host.close()


_SERVES = itertools.count()
