"""EngineLoop: dockrl's continuous-batching RolloutEngine behind an async `generate`, for `dockrl serve`.

```
 HTTP handlers (event loop) ── generate(prompt ids, sampling) ──▶ queue
 one engine thread: admit what is queued while slots are free ─▶ engine.step() ─▶ finished samples resolve
                    their futures on the event loop (call_soon_threadsafe)
```

Requests that arrive together share the engine's steps (one batched forward per step for all of them); the
engine thread sleeps on the queue when nothing runs.
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
        self.thread = threading.Thread(target=self._serve, name="dockrl-serve-engine", daemon=True)
        self.thread.start()

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Sampled:
        """Sample one completion of `prompt_ids`."""
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
        while True:
            for item in self._arrived(block=not self.engine.has_work()):
                if item is None:
                    return
                request, future, loop = item
                self.waiting[request.tag] = (future, loop)
                self.engine.add(request)
            if self.engine.has_work():
                self._step()

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
        try:
            done = self.engine.step()
        except Exception as exc:  # the engine broke: every waiting request learns it
            for future, loop in self.waiting.values():
                loop.call_soon_threadsafe(_fail, future, exc)
            self.waiting.clear()
            return
        self.steps += 1
        for completion in done:
            future, loop = self.waiting.pop(completion.tag)
            gen = completion.generation
            sampled = Sampled(gen.token_ids.tolist(), gen.logprobs.tolist(), gen.finish_reason)
            loop.call_soon_threadsafe(_resolve, future, sampled)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
