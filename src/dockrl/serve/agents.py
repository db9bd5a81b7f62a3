"""Agent functions: a user's agent, written against the `openai` client, run over dockrl's engine.

```
 env.name / --agent: ./my_agent.py:solve  or  package.module:solve
     async def solve(client, row) -> float | None
         client  openai.AsyncOpenAI whose base URL names this sample's session (/s/<session>/v1): its requests
                 are answered by the engine and recorded for the sample
         row     the dataset row ({"prompt": ..., "label": ..., ...})
         return  the sample's reward; None: the reward functions score its final assistant message
```

The agent does its own tool calls, retries and bookkeeping; many samples run at once (`concurrency`) and their
requests are decoded together. A sample whose agent raises or runs past `timeout_s` is failed, never the run.
`dockrl eval --agent` measures one held out (`evaluate_agent`); training agent functions through a run's rollout
is not built yet (docs/serve.md).
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[float | None]]


def load_agent(name: str, search_dirs: list[Path] | None = None) -> AgentFn:
    """The agent function `name` names (a file `path/to/agent.py:solve`, relative to `search_dirs` or the working
    directory, or `package.module:solve`); ValueError when it is missing or not an `async def`."""
    from dockrl.config.loader import locate_reward_file
    from dockrl.user_code import attr_from_code, import_attr

    found = locate_reward_file(name, search_dirs or [Path.cwd()], what="agent")
    if found is not None:
        solve = attr_from_code(name, found.read_text(encoding="utf-8"), str(found), "agent")
    else:
        solve = import_attr(name, "agent")
    if not inspect.iscoroutinefunction(solve):
        raise ValueError(f"agent {name!r} must be an `async def solve(client, row) -> float | None`")
    return solve


@dataclass
class Session:
    """One sample's agent run: its requests as answered, how it ended."""

    requests: list[tuple[list[int], list[int], str]] = field(
        default_factory=list
    )  # prompt ids, sampled, text
    reward: float | None = None
    failed: str | None = None
    seconds: float = 0.0

    @property
    def final(self) -> str:
        """The last assistant message the agent got."""
        return self.requests[-1][2] if self.requests else ""


class Sessions:
    """What the server records per session (server.SessionHooks): each answered request; chats render plainly."""

    def __init__(self) -> None:
        self.by_name: dict[str, Session] = {}

    def render(self, name: str, messages: list[dict[str, Any]], tools: list | None) -> list[int] | None:
        return None

    def answered(self, name: str, prompt_ids: list[int], sampled: Any, text: str, reply: dict) -> None:
        session = self.by_name.get(name)
        if session is not None:  # an unknown session (a stale client) is answered, not recorded
            session.requests.append((list(prompt_ids), list(sampled.token_ids), text))

    def release(self, name: str) -> None:
        pass


async def run_agents(
    solve: AgentFn,
    rows: list[dict[str, Any]],
    base_url: str,
    api_key: str,
    sessions: Sessions,
    *,
    concurrency: int = 16,
    timeout_s: float = 300.0,
) -> list[Session]:
    """Run `solve` on every row, `concurrency` at a time, each within `timeout_s`; one Session per row."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    token = secrets.token_hex(4)

    async def one(i: int, row: dict[str, Any]) -> Session:
        name = f"{token}-{i}"
        session = sessions.by_name[name] = Session()
        client = openai.AsyncOpenAI(base_url=f"{base_url}/s/{name}/v1", api_key=api_key, max_retries=0)
        async with gate:
            start = time.perf_counter()
            try:
                reward = await asyncio.wait_for(solve(client, dict(row)), timeout_s)
                session.reward = None if reward is None else float(reward)
            except TimeoutError:
                session.failed = f"the agent ran past its {timeout_s:g} s"
            except Exception as exc:  # the agent's failure is its sample's, never the run's
                session.failed = f"{type(exc).__name__}: {exc}"
            finally:
                session.seconds = time.perf_counter() - start
                await client.close()
        return session

    return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))
