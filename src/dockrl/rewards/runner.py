"""RewardRunner: score a batch with weighted reward functions in worker processes, with per-call timeouts.

```
 score(prompts, responses, labels): one call per (sample, reward fn), queued
   |
   v  each slot = a single-process ProcessPoolExecutor("spawn") running at most one call at a time
 slot lifecycle:   warming --ping returns pid--> idle --submit call--> busy --result--> idle
                      ^                                                  |
                      +------------- replaced (new process) <------------+ call ran past timeout_s:
                                                                           SIGKILL the process, score 0,
                                                                           stats["timeouts"] += 1
 the driver polls every 50 ms; other slots keep working (and stay warm) while one is replaced
```

Why one executor per worker process: ``ProcessPoolExecutor`` cannot kill one task, and killing one of its
workers breaks the whole pool (every in-flight call is lost, every warm worker restarts). With one process
per executor the runner knows which call runs where, kills only the hung process, and replaces only it.

Why "spawn": the runner lives inside a Ray actor that may have torch, CUDA and gRPC threads loaded.
``fork`` copies that process with locks possibly held by threads that do not exist in the child (hangs)
and with a CUDA context that cannot be used there. "forkserver" is safe too, but its server is a shared,
process-wide singleton whose preload list is global state. "spawn" starts fresh interpreters; note that
they re-import the parent's ``__main__`` module, so a script must guard its entry point with
``if __name__ == "__main__":`` (the runner raises a RuntimeError saying so when workers die at start-up).

Start-up: a new worker resolves every RewardSpec and runs each function's optional ``warmup`` (see
``rewards/base.py``); a slot takes calls only after that, so imports never count against ``timeout_s``.

Cheap functions inline (``inline``, reward.inline): a call through the pool costs a pipe round trip (about a
millisecond: 256 exact_answer calls took 0.28 s through it, 2-3 ms inline), far more than a regex. With
``inline="cheap"`` (the default) the functions ``rewards.base.is_cheap`` accepts (exact_answer, format with its
own pattern, user functions declaring ``cheap = True``) run in one daemon thread of the calling process, the
others in the pool at the same time; ``"all"`` runs every function so, ``"none"`` none. An inline call cannot be
killed, so one past ``timeout_s`` raises RewardTimeoutError naming the function (the run stops; the thread is
abandoned) instead of scoring 0: the wait is bounded for calls that run Python code or wait on I/O, not for one
stuck in C code that holds the GIL (why user functions default to the pool).

``num_processes=0`` runs every call inline in the calling thread, without timeouts, for debugging.
The pool is created on the first ``score`` call that needs it and reused until ``close()`` (or the end of a
``with``).
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import threading
import time
import traceback
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from dockrl.rewards.base import RewardFn, RewardResult, is_cheap, resolve_reward_fn, warmup_of

logger = logging.getLogger(__name__)

_POLL_S = 0.05
# A worker that has not finished start-up (imports, warmup) in this long is considered broken.
_STARTUP_TIMEOUT_S = 120.0


def accuracy_key(components: dict[str, list[float]]) -> str | None:
    """The component that says whether an answer is correct (`<fn>/correct`), if any function reports one."""
    return next((k for k in components if k.endswith("/correct")), None)


@dataclass
class RewardSpec:
    """One reward function in the weighted sum.

    Attributes:
        name: built-in name ("exact_answer", "math_verify", "format") or "package.module:function";
            also the metric key prefix, so names must be unique within a runner.
        weight: multiplier of this function's score in the total.
        kwargs: extra keyword arguments bound to the function (e.g. ``{"pattern": ...}`` for "format").
        code, origin: the source and path of a function given as a file (`path/file.py:function`).
    """

    name: str
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    code: str | None = None  # the source of a function given as a file (rewards.base.resolve_reward_fn)
    origin: str | None = None  # that file's path


# An outcome is ("ok", score, components), ("error", traceback text) or ("timeout",).
_Outcome = tuple

# ---------------------------------------------------------------- worker process side

_worker_fns: list[RewardFn] = []


def _init_worker(specs: list[tuple[str, dict, str | None, str | None]]) -> None:
    """Executor initializer: resolve every reward function and run its warmup, once per process."""
    _worker_fns[:] = [resolve_reward_fn(*spec) for spec in specs]
    for fn in _worker_fns:
        warmup = warmup_of(fn)
        if warmup is not None:
            warmup()


def _ping() -> None:
    """A no-op task: its completion tells the driver that the worker finished start-up."""


def _run_in_worker(spec_index: int, prompt: str, response: str, label: Any) -> _Outcome:
    return _call(_worker_fns[spec_index], prompt, response, label)


def _call(fn: RewardFn, prompt: str, response: str, label: Any) -> _Outcome:
    """Run one reward function; never raises. Components are coerced to float to cross the process pipe."""
    try:
        result = fn(prompt, response, label)
        if isinstance(result, RewardResult):
            score, components = float(result.score), {k: float(v) for k, v in result.components.items()}
        elif isinstance(result, int | float):
            score, components = float(result), {}
        else:
            raise TypeError(
                f"reward function returned {type(result).__name__}; expected RewardResult or float"
            )
        if not math.isfinite(score):
            raise ValueError(f"reward function returned a non-finite score {score}")
        return ("ok", score, components)
    except Exception:
        return ("error", traceback.format_exc())


# ---------------------------------------------------------------- driver side

INLINE_MODES = ("cheap", "all", "none")


class RewardTimeoutError(RuntimeError):
    """An inline reward call ran past its timeout; it cannot be stopped, so the scoring stops."""


class _InlineBatch:
    """Inline calls run one after another in a daemon thread; the caller waits on each call's deadline."""

    def __init__(self, fns: list[RewardFn], calls: list[tuple[int, int]], prompts, responses, labels):
        self.outcomes: list[_Outcome | None] = [None] * len(calls)
        self.current: tuple[int, float] | None = None  # (call position, its start) while a call runs
        self.calls = calls

        def run() -> None:
            for position, (i, j) in enumerate(calls):
                self.current = (position, time.monotonic())
                self.outcomes[position] = _call(fns[j], prompts[i], responses[i], labels[i])
            self.current = None

        self.thread = threading.Thread(target=run, name="dockrl-inline-rewards", daemon=True)
        self.thread.start()

    def wait(self, timeout_s: float, specs: list[RewardSpec], mode: str) -> list[_Outcome]:
        """The outcomes once every call returned; RewardTimeoutError when one runs past `timeout_s`."""
        while self.thread.is_alive():
            current = self.current
            remaining = _POLL_S if current is None else current[1] + timeout_s - time.monotonic()
            if remaining <= 0 and current is not None and self.current == current:
                sample, spec = self.calls[current[0]]
                raise RewardTimeoutError(
                    f"reward function {specs[spec].name!r} ran inline (reward.inline={mode}) for more than "
                    f"reward.timeout_s={timeout_s} s on sample {sample}; an inline call cannot be stopped: run it "
                    "in the process pool (reward.inline=none, or drop its `cheap = True`) or raise "
                    "reward.timeout_s"
                )
            self.thread.join(max(remaining, 0.0))
        done = [outcome for outcome in self.outcomes if outcome is not None]
        assert len(done) == len(self.outcomes), "every inline call ends with an outcome"
        return done


class _Slot:
    """One worker process behind its own single-process executor; holds at most one call."""

    def __init__(self, specs: list[tuple[str, dict, str | None, str | None]]):
        self.executor = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(specs,),
        )
        self.created_at = time.monotonic()
        self.ping: Future | None = self.executor.submit(_ping)  # done once start-up finished
        self.call_id: int | None = None
        self.future: Future | None = None
        self.submitted_at = 0.0

    @property
    def idle(self) -> bool:
        return self.ping is None and self.future is None

    def submit(self, call_id: int, args: tuple) -> None:
        self.call_id, self.submitted_at = call_id, time.monotonic()
        self.future = self.executor.submit(_run_in_worker, *args)

    def take_result(self) -> tuple[int, Future]:
        call_id, future = self.call_id, self.future
        assert call_id is not None and future is not None, "take_result of a slot with no call"
        self.call_id = self.future = None
        return call_id, future

    def kill(self) -> None:
        """SIGKILL the worker (it may be stuck in C code that ignores SIGTERM) and drop the executor."""
        kill_workers = getattr(self.executor, "kill_workers", None)
        if kill_workers is not None:  # Python >= 3.14
            kill_workers()
            return
        # Before 3.14 ProcessPoolExecutor has no public way to stop a busy worker; its process table is
        # the only handle. The executor notices the death, fails nothing of ours (we dropped the call).
        for process in list((self.executor._processes or {}).values()):
            process.kill()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker: politely when it is idle, by SIGKILL when it is busy or still starting."""
        if self.idle:
            self.executor.shutdown(wait=True, cancel_futures=True)
        else:
            self.kill()


class RewardRunner:
    """Scores batches as ``sum(weight * fn(prompt, response, label))`` over a list of RewardSpecs.

    Args:
        specs: the reward functions; resolved here, so unknown names or bad kwargs fail at construction.
        timeout_s: per-call limit; a call past it scores 0, is counted in ``stats["timeouts"]``, and its
            worker process is killed and replaced.
        num_processes: worker processes; 0 runs inline (no timeout), for debugging.
        inline: which functions run in a thread of this process instead of the pool (the module docstring):
            "cheap" (rewards.base.is_cheap), "all" or "none".
    """

    def __init__(
        self,
        specs: list[RewardSpec],
        *,
        timeout_s: float = 5.0,
        num_processes: int = 1,
        inline: str = "cheap",
    ):
        if not specs:
            raise ValueError("RewardRunner needs at least one RewardSpec")
        names = [spec.name for spec in specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(
                f"reward spec names must be unique (they key the metrics); repeated: {duplicates}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
        if num_processes < 0:
            raise ValueError(f"num_processes must be >= 0 (0 = inline); got {num_processes}")
        if inline not in INLINE_MODES:
            raise ValueError(f"inline must be one of {INLINE_MODES}; got {inline!r}")
        self.specs = list(specs)
        self.timeout_s = timeout_s
        self.num_processes = num_processes
        self.inline = inline
        self._fns = [resolve_reward_fn(spec.name, spec.kwargs, spec.code, spec.origin) for spec in specs]
        # per spec: whether its calls run in this process (all of them with num_processes=0)
        self._inline = [
            num_processes == 0 or inline == "all" or (inline == "cheap" and is_cheap(fn)) for fn in self._fns
        ]
        self._slots: list[_Slot] = []
        self._call_ids = itertools.count()
        self._logged: set[tuple[str, str]] = set()

    # ------------------------------------------------------------ public API

    def score(
        self, prompts: list[str], responses: list[str], labels: list
    ) -> tuple[list[float], dict[str, list[float]], dict[str, Any]]:
        """Score one batch.

        Returns:
            totals: weighted score per sample.
            components: per-sample lists keyed ``"<fn name>"`` (that function's score) and
                ``"<fn name>/<component>"``; a sample where the function failed or timed out has 0 there.
            stats: ``{"timeouts": n, "errors": n, "failed": [sample index, ...]}`` over the calls of this
                batch; a sample is failed when any of its calls timed out or raised.
        """
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(
                f"prompts, responses and labels must have equal lengths; got "
                f"{len(prompts)}, {len(responses)}, {len(labels)}"
            )
        calls = [(i, j) for i in range(len(prompts)) for j in range(len(self.specs))]
        if self.num_processes == 0:
            outcomes = [_call(self._fns[j], prompts[i], responses[i], labels[i]) for i, j in calls]
            return self._assemble(len(prompts), calls, outcomes)
        here = [call for call in calls if self._inline[call[1]]]
        pooled = [call for call in calls if not self._inline[call[1]]]
        batch = _InlineBatch(self._fns, here, prompts, responses, labels) if here else None
        got = dict(
            zip(pooled, self._run_in_slots([(j, prompts[i], responses[i], labels[i]) for i, j in pooled]))
        )
        if batch is not None:  # the pool's calls ran meanwhile
            got.update(zip(here, batch.wait(self.timeout_s, self.specs, self.inline)))
        return self._assemble(len(prompts), calls, [got[call] for call in calls])

    def close(self) -> None:
        """Stop the worker processes; the runner may be used again (it starts new ones)."""
        for slot in self._slots:
            slot.close()
        self._slots = []

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ execution

    def _spec_args(self) -> list[tuple[str, dict, str | None, str | None]]:
        return [(spec.name, spec.kwargs, spec.code, spec.origin) for spec in self.specs]

    def _run_in_slots(self, args: list[tuple]) -> list[_Outcome]:
        if not args:
            return []
        if not self._slots:
            self._slots = [_Slot(self._spec_args()) for _ in range(self.num_processes)]
        outcomes: list[_Outcome | None] = [None] * len(args)
        pending = deque(range(len(args)))
        while pending or any(slot.future is not None for slot in self._slots):
            for slot in self._slots:
                if slot.idle and pending:
                    index = pending.popleft()
                    slot.submit(index, args[index])
            waiting = [f for slot in self._slots for f in (slot.ping, slot.future) if f is not None]
            wait(waiting, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            for position, slot in enumerate(self._slots):
                self._advance(position, slot, outcomes)
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(outcomes), "every call ends with an outcome"
        return done

    def _advance(self, position: int, slot: _Slot, outcomes: list[_Outcome | None]) -> None:
        """Move one slot along its lifecycle: finish start-up, collect a result, or kill a hung call."""
        if slot.ping is not None:
            if slot.ping.done():
                self._finish_startup(slot)
            elif time.monotonic() - slot.created_at > _STARTUP_TIMEOUT_S:
                self.close()
                raise RuntimeError(
                    f"a reward worker did not finish start-up (imports, warmup) in {_STARTUP_TIMEOUT_S} s"
                )
            return
        if slot.future is None:
            return
        if slot.future.done():
            index, future = slot.take_result()
            exc = future.exception()
            if exc is None:
                outcomes[index] = future.result()
                return
            outcomes[index] = ("error", "".join(traceback.format_exception(exc)))
            if not isinstance(exc, BrokenProcessPool):
                return  # e.g. a label that cannot be pickled: the worker itself is fine
            # else the worker died mid-call (segfault, os._exit, OOM kill): replace it below
        elif time.monotonic() - slot.submitted_at > self.timeout_s:
            index, _ = slot.take_result()
            outcomes[index] = ("timeout",)
        else:
            return
        # Only this slot's process is replaced; the other slots keep running meanwhile.
        slot.kill()
        self._slots[position] = _Slot(self._spec_args())

    def _finish_startup(self, slot: _Slot) -> None:
        assert slot.ping is not None
        exc = slot.ping.exception()
        slot.ping = None
        if exc is None:
            return
        self.close()
        raise RuntimeError(
            "reward worker process exited during start-up (its traceback is on stderr). Workers are "
            "started with 'spawn' and re-import the main module: a script must guard its entry point with "
            "`if __name__ == '__main__':`"
        ) from exc

    # ------------------------------------------------------------ results

    def _assemble(
        self, num_samples: int, calls: list[tuple[int, int]], outcomes: list[_Outcome]
    ) -> tuple[list[float], dict[str, list[float]], dict[str, Any]]:
        totals = [0.0] * num_samples
        components = {spec.name: [0.0] * num_samples for spec in self.specs}
        stats: dict = {"timeouts": 0, "errors": 0, "failed": []}
        failed: set[int] = set()
        for (i, j), outcome in zip(calls, outcomes):
            spec = self.specs[j]
            if outcome[0] == "ok":
                _, score, parts = outcome
                totals[i] += spec.weight * score
                components[spec.name][i] = score
                for key, value in parts.items():
                    components.setdefault(f"{spec.name}/{key}", [0.0] * num_samples)[i] = value
            elif outcome[0] == "timeout":
                stats["timeouts"] += 1
                failed.add(i)
                self._log_once(
                    spec.name, "timeout", f"reward function {spec.name!r} exceeded timeout_s={self.timeout_s}"
                )
            else:
                stats["errors"] += 1
                failed.add(i)
                self._log_once(spec.name, "error", f"reward function {spec.name!r} failed:\n{outcome[1]}")
        stats["failed"] = sorted(failed)
        return totals, components, stats

    def _log_once(self, name: str, kind: str, message: str) -> None:
        if (name, kind) in self._logged:
            return
        self._logged.add((name, kind))
        logger.warning(
            "%s\n(scored 0; later %ss of this function are counted in stats, not logged)", message, kind
        )
