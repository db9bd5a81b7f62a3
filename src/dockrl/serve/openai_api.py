"""The OpenAI API's shapes, as dockrl serves them: requests checked and rendered to token ids, generations turned
into responses. No torch, no HTTP (server.py serves these).

```
 /v1/chat/completions  messages (+ tools) ─ chat template ─▶ prompt ids ─ engine ─▶ sampled ids, log-probs
                       ◀─ {choices: [{message: {content, tool_calls}, finish_reason, logprobs,
                                      token_ids}], prompt_token_ids, usage}
 /v1/completions       prompt (text or ids) ─▶ prompt ids ─ engine ─▶ {choices: [{text, logprobs, token_ids}]}
```

Supported: `messages` with system, user, assistant (text and/or `tool_calls`) and tool roles, `tools` (function
schemas, rendered by the chat template; the model's calls parsed in its family's format), `temperature`,
`top_p`, `max_tokens` / `max_completion_tokens` (capped by the server's limit), `stop`, `seed`, `logprobs`
(chosen token only). Refused with a 400 naming the field: `n` > 1, `stream`, `top_logprobs` > 0, `tool_choice`
other than "auto" or "none", `tools` for a model family without a tool-call format. Any `model` name is
accepted. The model's tool calls are parsed only when the request offers `tools` (and tool_choice is not
"none"); otherwise its text is the content, as it wrote it. `token_ids` and `prompt_token_ids` are dockrl's additions: the exact ids, so a caller never
re-tokenizes what was sampled.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from dockrl.envs.tool_calls import (
    ToolCall,
    format_tool_calls,
    parse_tool_calls,
    text_outside_calls,
    tool_call_families,
)


class ApiError(Exception):
    """An error the client gets in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(
        extra="allow"
    )  # fields dockrl does not read are ignored, as OpenAI's servers do

    model: str = "dockrl"
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False


class ChatRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[int]
    logprobs: int | None = None


@dataclass(frozen=True)
class Sampling:
    """What the engine is asked for: sampling settings after the server's caps."""

    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None


@dataclass(frozen=True)
class Sampled:
    """What the engine answered for one request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


def check_common(request: _Request, max_tokens_cap: int, asked: int | None) -> Sampling:
    """The request's sampling settings within the server's limits; ApiError(400) naming what is not served."""
    if request.n != 1:
        raise ApiError(400, f"n={request.n}: dockrl serves one choice per request; send n=1", "n")
    if request.stream:
        raise ApiError(400, "stream=true is not served; send stream=false", "stream")
    for name, value, low, high in (
        ("temperature", request.temperature, 0.0, 2.0),
        ("top_p", request.top_p, 0.0, 1.0),
    ):
        if value is not None and not low <= value <= high:
            raise ApiError(400, f"{name}={value} must be in [{low}, {high}]", name)
    if request.top_p is not None and request.top_p == 0:
        raise ApiError(400, "top_p=0 must be in (0, 1]", "top_p")
    if asked is not None and asked < 1:
        raise ApiError(400, f"max_tokens={asked} must be at least 1", "max_tokens")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return Sampling(
        max_tokens=min(asked or max_tokens_cap, max_tokens_cap),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=stop,
        seed=request.seed,
    )


def chat_sampling(request: ChatRequest, max_tokens_cap: int) -> Sampling:
    if request.top_logprobs:
        raise ApiError(400, "top_logprobs > 0 is not served (the chosen token's log-prob is)", "top_logprobs")
    if request.tool_choice not in (None, "auto", "none"):
        raise ApiError(
            400, f'tool_choice={request.tool_choice!r} is not served; use "auto" or "none"', "tool_choice"
        )
    return check_common(request, max_tokens_cap, request.max_completion_tokens or request.max_tokens)


def chat_messages(request: ChatRequest, family: str) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them: text content, and an assistant's `tool_calls`
    written back in the model family's format (what the model wrote when it made them: the content, then the
    calls on lines of their own, as Qwen2.5's chat template lays them out)."""
    if request.tools and family not in tool_call_families():
        raise ApiError(
            400,
            f"tools: model family {family!r} has no tool-call format (families with one: "
            f"{', '.join(tool_call_families())})",
            "tools",
        )
    out = [template_message(message, i, family) for i, message in enumerate(request.messages)]
    if not out:
        raise ApiError(400, "messages is empty", "messages")
    return out


def template_message(message: dict[str, Any], index: int, family: str) -> dict[str, Any]:
    """One OpenAI message (messages[index]) as the chat template takes it (chat_messages)."""
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ApiError(
            400, f"messages[{index}].role={role!r}: use system, user, assistant or tool", "messages"
        )
    content = _text(message.get("content"), index)
    if role == "assistant" and message.get("tool_calls"):
        calls = format_tool_calls([_tool_call(call, index) for call in message["tool_calls"]], family)
        content = f"{content}\n{calls}" if content else calls
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, f"messages[{index}].content: text only (a string or text parts)", "messages")


def _tool_call(call: dict[str, Any], index: int) -> ToolCall:
    """An OpenAI tool call ({"function": {"name", "arguments": JSON string}}) of messages[index]."""
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise ApiError(
            400, f"messages[{index}]: tool call arguments are not JSON: {arguments[:80]!r}", "messages"
        ) from None
    if not isinstance(parsed, dict) or not isinstance(function.get("name"), str):
        raise ApiError(
            400, f"messages[{index}]: a tool call needs a function name and JSON-object arguments", "messages"
        )
    return ToolCall(function["name"], parsed)


def chat_response(
    model: str,
    prompt_ids: list[int],
    sampled: Sampled,
    text: str,
    family: str,
    tokens: list[str],
    with_logprobs: bool,
    parse_tools: bool = False,
) -> dict[str, Any]:
    """A chat.completion for `sampled` (`text`: its decoded message without the stop token; `tokens`: each
    sampled token's text). With `parse_tools` (the request offered tools) the calls in `text`, in `family`'s
    format, become `tool_calls` and the content is the text around them; a block that does not parse leaves
    the whole text as content, with no calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = sampled.finish_reason
    parsed = parse_tool_calls(text, family) if parse_tools else None
    calls = parsed.calls if parsed is not None and not parsed.errors else []
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
            }
            for call in calls
        ]
        message["content"] = text_outside_calls(text, family) or None
        finish = "tool_calls" if finish == "stop" else finish
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish,
        "token_ids": sampled.token_ids,
    }
    choice["logprobs"] = (
        {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, sampled.logprobs)
            ]
        }
        if with_logprobs
        else None
    )
    return _envelope("chat.completion", model, prompt_ids, sampled, [choice])


def completion_response(
    model: str, prompt_ids: list[int], sampled: Sampled, text: str, tokens: list[str], with_logprobs: bool
) -> dict[str, Any]:
    """A text_completion for `sampled`."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "finish_reason": sampled.finish_reason,
        "token_ids": sampled.token_ids,
        "logprobs": {
            "tokens": tokens,
            "token_logprobs": sampled.logprobs,
            "top_logprobs": None,
            "text_offset": None,
        }
        if with_logprobs
        else None,
    }
    return _envelope("text_completion", model, prompt_ids, sampled, [choice])


def _envelope(
    kind: str, model: str, prompt_ids: list[int], sampled: Sampled, choices: list
) -> dict[str, Any]:
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "prompt_token_ids": prompt_ids,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(sampled.token_ids),
            "total_tokens": len(prompt_ids) + len(sampled.token_ids),
        },
    }


def models_response(model: str) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "dockrl"}]}
