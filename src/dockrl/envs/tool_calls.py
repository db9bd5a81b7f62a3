"""Tool calls in an assistant message, in the model family's own format (`Family.tool_call_format` in
models/families/ names it for each family).

    qwen           <tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>
                   (several blocks for several calls; Qwen2.5 and Qwen3 chat templates teach this form)
    llama          Llama 3.1 and later: the message is a JSON object {"name": ..., "parameters": {...}}
                   (or several separated by ";"), optionally after the <|python_tag|> token

A block that does not parse (bad JSON, no name, arguments that are not an object, an unterminated tag) is not
a call: it is returned as an error, which the environment shows the model as an error observation and counts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dockrl.models.families import FAMILIES, ToolCallFormat

QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedMessage:
    """The calls an assistant message makes, and why any block that looked like a call is not one."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def tool_call_families() -> list[str]:
    """The families whose tool calls dockrl parses, sorted."""
    return sorted(name for name, family in FAMILIES.items() if family.tool_call_format is not None)


def parse_tool_calls(text: str, family: str) -> ParsedMessage:
    """The tool calls in `text` (an assistant message) in `family`'s format (`Family.tool_call_format`)."""
    return PARSERS[_format_of(family)](text)


def _parse_qwen(text: str) -> ParsedMessage:
    out = ParsedMessage()
    for body in QWEN_CALL.findall(text):
        _add(out, body.strip(), "arguments")
    closed = len(QWEN_CALL.findall(text))
    if text.count(QWEN_OPEN) > closed:
        out.errors.append(f"a {QWEN_OPEN} block is not closed with {QWEN_CLOSE}")
    return out


def _parse_llama(text: str) -> ParsedMessage:
    out = ParsedMessage()
    body = text.strip()
    tagged = body.startswith(LLAMA_PYTHON_TAG)
    body = body.removeprefix(LLAMA_PYTHON_TAG).strip()
    if not body.startswith("{"):
        if tagged:
            out.errors.append(f"{LLAMA_PYTHON_TAG} is not followed by a JSON call")
        return out
    for part in _split_calls(body):
        _add(out, part, "parameters")
    return out


PARSERS: dict[ToolCallFormat, Callable[[str], ParsedMessage]] = {"qwen": _parse_qwen, "llama": _parse_llama}
"""The parser of each tool-call format (module docstring)."""


def format_tool_calls(calls: list[ToolCall], family: str) -> str:
    """The text `family`'s model writes for `calls`, which `parse_tool_calls` reads back: qwen one block per
    call, newline-separated, laid out as Qwen2.5's chat template renders an assistant's `tool_calls`; llama
    the JSON objects joined by "; ". JSON as chat templates' `tojson` writes it (non-ASCII kept)."""
    form = _format_of(family)
    if form == "qwen":
        return "\n".join(
            f"{QWEN_OPEN}\n{_json({'name': c.name, 'arguments': c.arguments})}\n{QWEN_CLOSE}" for c in calls
        )
    return "; ".join(_json({"name": c.name, "parameters": c.arguments}) for c in calls)


def text_outside_calls(text: str, family: str) -> str:
    """What an assistant message says besides its tool calls (stripped): qwen the text around the complete
    <tool_call> blocks; llama, whose calls are the whole message, nothing when it makes calls."""
    if _format_of(family) == "qwen":
        return QWEN_CALL.sub("", text).strip()
    return "" if _parse_llama(text).calls else text.strip()


def _format_of(family: str) -> ToolCallFormat:
    record = FAMILIES.get(family)
    form = None if record is None else record.tool_call_format
    if form is None:
        raise ValueError(f"no tool-call format for model family {family!r}; known: {tool_call_families()}")
    return form


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _split_calls(body: str) -> list[str]:
    """JSON objects separated by ';' (Llama's several calls), split at top-level semicolons only."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, char in enumerate(body):
        if in_string:
            escaped = char == "\\" and not escaped
            if char == '"' and not escaped:
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == ";" and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return [p for p in parts if p]


def _add(out: ParsedMessage, body: str, arguments_key: str) -> None:
    """Parse one call's JSON into `out.calls`, or say why not in `out.errors`."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        out.errors.append(
            f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): {body[:80]!r}"
        )
        return
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        out.errors.append(f'a tool call needs {{"name": str, "{arguments_key}": {{...}}}}, got {body[:80]!r}')
        return
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        out.errors.append(f"the arguments of tool {value['name']!r} are not a JSON object: {arguments!r}")
        return
    out.calls.append(ToolCall(value["name"], arguments))
