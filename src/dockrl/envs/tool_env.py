"""ToolEnvironment: the built-in environment of `env.name=tools`, and the base class of tool-using user
environments.

    reset(row)    the dataset prompt as the first user turn
    step(text)    the tool calls in the assistant message (parsed in the model family's format) run, each
                  answered by a tool message; a block that is not a valid call, an unknown tool or a tool
                  error is answered with "Error: ..." (counted in info["tool_errors"]), a call past its time
                  with "Error: ... stopped" (info["timeouts"]); a message without a call ends the trajectory
                  (done, no reward of its own: reward functions score the final answer)

A user environment may subclass it and override `reward(message)` (the final reward when the trajectory
ends, None by default) or `reset`.
"""

from __future__ import annotations

from typing import Any

from dockrl.envs.base import Message, Observation, time_left, tool_calls_left
from dockrl.envs.tool_calls import parse_tool_calls
from dockrl.envs.tools import Tool, ToolError, ToolTimeout, build_tools


class ToolEnvironment:
    """Tools by name (`tools`: built-ins, see envs.tools.BUILTIN_TOOLS); `family` picks the tool-call format,
    `call_timeout_s` limits each call and `allow_unsandboxed` lets the python tool run without bubblewrap (set by
    the rollout from the model, env.call_timeout_s and env.allow_unsandboxed)."""

    def __init__(
        self,
        tools: list[str] | tuple[str, ...] = ("calculator",),
        *,
        family: str = "qwen2",
        call_timeout_s: float = 10.0,
        tool_objects: list[Tool] | None = None,
        allow_unsandboxed: bool = False,
    ):
        self.tool_objects = (
            tool_objects if tool_objects is not None else build_tools(list(tools), allow_unsandboxed)
        )
        self.by_name = {tool.name: tool for tool in self.tool_objects}
        self.tools = [tool.schema for tool in self.tool_objects]
        self.family, self.call_timeout_s = family, call_timeout_s
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> Observation:
        """The dataset prompt as the first user message."""
        self.row = row
        return Observation(messages=[{"role": "user", "content": str(row["prompt"])}])

    def reward(self, message: str) -> float | None:
        """The trajectory's final reward given its last assistant message; None: reward functions score it."""
        return None

    def step(self, message: str) -> Observation:
        """Run the message's tool calls; a message without one ends the trajectory."""
        parsed = parse_tool_calls(message, self.family)
        if not parsed.calls and not parsed.errors:
            return Observation(done=True, reward=self.reward(message))
        answers: list[Message] = [_tool_message(f"Error: {error}") for error in parsed.errors]
        info = {"tool_calls": len(parsed.calls) + len(parsed.errors), "tool_errors": len(parsed.errors)}
        info["timeouts"] = 0
        allowed = max(0, tool_calls_left() - len(parsed.errors))  # env.max_tool_calls: the rest never run
        for i, call in enumerate(parsed.calls):
            tool = self.by_name.get(call.name)
            # the step's clock: its calls share its limit, and each ends a little before it, so a slow tool is
            # an error the model reads, not a step cut at its deadline
            limit = min(self.call_timeout_s, 0.95 * time_left())
            if i >= allowed:
                answers.append(_tool_message("Error: the trajectory's tool calls are used up; not run"))
            elif tool is None:
                answers.append(_tool_message(f"Error: no tool {call.name!r}; tools: {sorted(self.by_name)}"))
                info["tool_errors"] += 1
            elif limit <= 0:
                answers.append(_tool_message("Error: the step's time is used up; not run"))
                info["timeouts"] += 1
            else:
                answers.append(self._run(tool, call.arguments, limit, info))
        return Observation(messages=answers, info=info)

    @staticmethod
    def _run(tool: Tool, arguments: dict[str, Any], limit: float, info: dict[str, int]) -> Message:
        """One tool call's answer (an error is the answer the model sees, counted in `info`)."""
        try:
            return _tool_message(tool.run(arguments, limit))
        except ToolTimeout as exc:
            info["timeouts"] += 1
            return _tool_message(f"Error: {exc}")
        except ToolError as exc:
            info["tool_errors"] += 1
            return _tool_message(f"Error: {exc}")
        except Exception as exc:  # a tool's own failure is an answer the model reads, not a failed trajectory
            info["tool_errors"] += 1
            return _tool_message(f"Error: the tool failed: {type(exc).__name__}: {exc}")


def _tool_message(content: str) -> Message:
    return {"role": "tool", "content": content}
