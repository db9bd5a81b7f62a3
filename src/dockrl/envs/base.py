"""The environment interface of multi-turn rollout (docs/multiturn.md).

An environment plays the other side of one trajectory: `reset(row)` gives the first turn from the dataset row,
then every assistant message the policy samples goes to `step(message)`, which answers with an Observation:

    reset(row)  -> Observation(messages=[{"role": "user", "content": ...}])      the first turn
    step(text)  -> Observation(messages=[{"role": "tool", "content": ...}, ...],  what the model sees next
                               reward=None, done=False, info={...})
    step(text)  -> Observation(done=True, reward=1.0)                             the trajectory ends

One instance serves one trajectory (a fresh one per row), built as `cls(**env.kwargs)` in an environment worker
process (envs/host.py, workers/env.py), so a slow environment holds up only its own trajectory. `reset` and
`step` may be plain or `async def`; each call may take env.call_timeout_s from the moment it starts
(`time_left()` says what remains; `tool_calls_left()` how many tool calls the trajectory may still make); an
optional `close()` runs when the trajectory ends. An environment that raises
drops its group under `reward.on_error`; one that returns non-messages is an error naming the environment.
For exact resume an environment must be deterministic given its row (and its own seed, if it draws any).

`tools`: JSON schemas (OpenAI function format) the chat template renders into the prompt (`tools=`), so the
model knows what it may call; the built-in ToolEnvironment fills them from its tools.
"""

from __future__ import annotations

import math
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]  # {"role": "user" | "tool" | "assistant" | "system", "content": str}


@dataclass
class Observation:
    """What the environment answers: messages the model sees next (or plain text: one user message), the
    reward when it has one (the final reward of the trajectory when `done`), whether the trajectory ends, and
    counters for metrics (`info["tool_calls"]`, `info["tool_errors"]`, `info["timeouts"]`)."""

    messages: list[Message] | str = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def as_messages(self) -> list[Message]:
        """`messages`, with plain text as one user message."""
        if isinstance(self.messages, str):
            return [{"role": "user", "content": self.messages}]
        return list(self.messages)


@dataclass(frozen=True)
class ModelRequest:
    """What an agent function's call answers instead of an Observation (serve/agent_host.py): the agent asked the
    policy for a completion of `prompt_ids` (its chat request rendered with the chat template, the ids sampled
    for its earlier assistant messages kept as they were sampled), at most `max_tokens` new tokens (None: the
    run's limit), ending also at `stop`; `tool_results`: the tool messages the request added since the last
    one (they count against env.max_tool_calls)."""

    prompt_ids: list[int]
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    tool_results: int = 0


@dataclass(frozen=True)
class CallBudget:
    """What the environment call running now may still spend: its deadline (time.monotonic) and the tool calls
    its trajectory has left (env.max_tool_calls minus those made)."""

    deadline: float
    tool_calls: int


current_budget: ContextVar[CallBudget | None] = ContextVar("dockrl_env_call", default=None)


def time_left() -> float:
    """Seconds the running environment call has left (its step's limit, env.call_timeout_s, counted from the
    moment it started); inf outside one. A tool gives each of its calls at most this."""
    budget = current_budget.get()
    return math.inf if budget is None else max(0.0, budget.deadline - time.monotonic())


def tool_calls_left() -> int:
    """Tool calls the running call's trajectory may still make; a large number outside one."""
    budget = current_budget.get()
    return 1 << 30 if budget is None else budget.tool_calls


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment (see the module docstring)."""

    tools: list[dict[str, Any]]

    def reset(self, row: dict[str, Any]) -> Observation:
        """The first turn, from the dataset row ({"prompt": text, "label": ground truth, ...})."""
        ...

    def step(self, message: str) -> Observation:
        """Answer the policy's assistant message (its decoded text, special tokens removed)."""
        ...


def check_messages(messages: Any, where: str) -> list[Message]:
    """`messages` as a list of {"role", "content"} dicts; ValueError naming `where` otherwise."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ValueError(
            f"{where} returned messages {str(messages)[:120]!r}: expected a string or a list of "
            '{"role": ..., "content": str} dicts'
        )
    return messages
