"""EngineLoop: dockrl's continuous-batching RolloutEngine behind an async `generate`, for `dockrl serve`.

```
 HTTP handlers (event loop) ── generate(prompt ids, sampling) ──▶ queue
 one engine thread: admit what is queued while slots are free ─▶ engine.step() ─▶ finished samples resolve
                    their futures on the event loop (call_soon_threadsafe)
```

Requests that arrive together share the engine's steps (one batched forward per step for all of them); the
engine thread sleeps on the queue when nothing runs. A request the engine refuses (`RolloutEngine.add`'s
ValueError, naming the limit) fails alone with that error. If a step raises, the engine's state is unknown:
every request waiting or running fails with the error, the thread ends, and later requests fail at once
(RuntimeError) instead of waiting on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import secrets
import threading
from typing import Any

from dockrl.engines.rollout.rollout_engine import Request, RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.serve.openai_api import Sampled, Sampling


class EngineLoop:
    """One RolloutEngine driven by one thread; `generate` may be awaited from any number of handlers."""

    def __init__(self, engine: RolloutEngine, stop_token_ids: list[int]):
        self.engine, self.stop_token_ids = engine, stop_token_ids
        self.incoming: queue.SimpleQueue[tuple[Request, asyncio.Future, asyncio.AbstractEventLoop] | None] = (
            queue.SimpleQueue()
        )
        self.waiting: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self.tags = itertools.count()
        self.steps = 0  # engine steps taken (what concurrent requests share)
        self.failed: BaseException | None = None  # set when a step raised: the thread has ended
        self.thread = threading.Thread(target=self._serve, name="dockrl-serve-engine", daemon=True)
        self.thread.start()

    async def generate(
        self, prompt_ids: list[int], sampling: Sampling, session: str | None = None
    ) -> Sampled:
        """Sample one completion of `prompt_ids` (any session's alike); ValueError when the engine can never fit
        the request."""
        if self.failed is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.failed}") from self.failed
        params = SamplingParams(
            max_new_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_token_ids=self.stop_token_ids,
            stop_strings=sampling.stop,
        )
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.incoming.put((Request(list(prompt_ids), [seed], params, tag=next(self.tags)), future, loop))
        return await future

    def close(self) -> None:
        self.incoming.put(None)

    def _serve(self) -> None:
        try:
            while True:
                for item in self._arrived(block=not self.engine.has_work()):
                    if item is None:
                        return
                    self._add(*item)
                if self.engine.has_work():
                    self._step()
        except (
            BaseException
        ) as exc:  # the engine's state is unknown: everyone waiting learns it, nobody hangs
            self.failed = exc
            for future, loop in self.waiting.values():
                _post(loop, _fail, future, exc)
            self.waiting.clear()
            for item in self._arrived(block=False):
                if item is not None:
                    _post(item[2], _fail, item[1], exc)

    def _add(self, request: Request, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.engine.add(request)
        except ValueError as exc:  # this request can never fit (the engine names the limit): it alone fails
            _post(loop, _fail, future, exc)
            return
        self.waiting[request.tag] = (future, loop)

    def _arrived(self, block: bool) -> list:
        """What was queued since the last look (waiting for the first when `block`)."""
        items = []
        try:
            items.append(self.incoming.get(block=block))
            while True:
                items.append(self.incoming.get_nowait())
        except queue.Empty:
            pass
        return items

    def _step(self) -> None:
        done = self.engine.step()
        self.steps += 1
        for completion in done:
            future, loop = self.waiting.pop(completion.tag)
            gen = completion.generation
            sampled = Sampled(gen.token_ids.tolist(), gen.logprobs.tolist(), gen.finish_reason)
            _post(loop, _resolve, future, sampled)


def _post(loop: asyncio.AbstractEventLoop, fn: Any, future: asyncio.Future, value: Any) -> None:
    """Run fn(future, value) on `loop`; nothing if that loop has closed (nobody waits any more)."""
    try:
        loop.call_soon_threadsafe(fn, future, value)
    except RuntimeError:  # the event loop is closed
        pass


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
