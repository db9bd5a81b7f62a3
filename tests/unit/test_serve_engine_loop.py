"""serve/engine_loop.py's EngineLoop over fake engines: a request the engine refuses fails alone, a step that
raises fails everyone waiting and every later request at once (nobody waits on a thread that is gone)."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from dockrl.serve.engine_loop import EngineLoop
from dockrl.serve.openai_api import Sampling

GREEDY = Sampling(max_tokens=2, temperature=0.0, top_p=1.0, stop=[], seed=0)


class OneStepEngine:
    """Finishes every added request at the next step with token 7 (log-prob -0.5); refuses prompts of 9 tokens
    as the real engine refuses what can never fit; `broken` makes step raise."""

    def __init__(self, broken: bool = False):
        self.added, self.broken = [], broken

    def add(self, request):
        if len(request.prompt_ids) == 9:
            raise ValueError("prompt of 9 tokens exceeds max_seq_len=8")
        self.added.append(request)

    def has_work(self):
        return bool(self.added)

    def step(self):
        if self.broken:
            raise RuntimeError("device lost")
        done, self.added = self.added, []
        generation = SimpleNamespace(
            token_ids=torch.tensor([7]), logprobs=torch.tensor([-0.5]), finish_reason="length"
        )
        return [SimpleNamespace(tag=r.tag, sample=0, generation=generation) for r in done]


def test_a_refused_request_fails_alone():
    loop = EngineLoop(OneStepEngine(), stop_token_ids=[0])

    async def both():
        both = asyncio.gather(
            loop.generate([1] * 9, GREEDY), loop.generate([1, 2], GREEDY), return_exceptions=True
        )
        return await asyncio.wait_for(both, timeout=10)

    refused, answered = asyncio.run(both())
    loop.close()
    assert isinstance(refused, ValueError) and "max_seq_len=8" in str(refused)
    assert answered.token_ids == [7] and answered.logprobs == [-0.5] and loop.steps == 1


def test_a_failed_step_fails_the_waiting_request_and_every_later_one():
    loop = EngineLoop(OneStepEngine(broken=True), stop_token_ids=[0])
    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(asyncio.wait_for(loop.generate([1, 2], GREEDY), timeout=10))
    loop.thread.join(timeout=10)
    assert not loop.thread.is_alive() and isinstance(loop.failed, RuntimeError)
    with pytest.raises(RuntimeError, match="engine stopped after an error: device lost"):
        asyncio.run(asyncio.wait_for(loop.generate([1, 2], GREEDY), timeout=10))
