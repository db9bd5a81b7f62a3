"""Observation tokens as the chat template's delta (engines/rollout/multi_turn.py's module docstring): what follows
the sampled tokens of an assistant turn, rendered once and encoded on its own. Pure Python (no torch): the
rollout and the agent host (serve/agent_host.py) share it.

Each observation takes three renders of the conversation, and two of them were made before: the conversation
before the turn is the previous observation's last render (the trajectory's history grew by exactly the
assistant message and the new ones), and a first turn's is the same for every sample of a prompt. `ChatDelta`
keeps its latest renders by the messages' content, so a rollout of g samples and t observations each renders
about 2t + 1/g times per trajectory instead of 3t. A template is taken as a function of its messages (and the
generation prompt and the tools it was built with).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

from dockrl.envs.base import Message


class ChatDelta:
    """Observation tokens as the chat template's delta (module docstring). `tokenizer` has
    apply_chat_template(messages, add_generation_prompt=..., tools=...), encode(text) and decode(ids,
    skip_special_tokens=...)."""

    RENDERS_KEPT = 1024  # latest renders kept (module docstring): a few KiB each

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]):
        self.tokenizer, self.tools = tokenizer, tools or None
        self._kept: OrderedDict[str, str] = OrderedDict()  # the messages' content -> their render
        self.renders = 0  # renders made, not found kept

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        key = json.dumps([generation_prompt, messages], sort_keys=True, default=repr)
        text = self._kept.get(key)
        if text is not None:
            self._kept.move_to_end(key)
            return text
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tools=self.tools
        )
        self.renders += 1
        self._kept[key] = text
        if len(self._kept) > self.RENDERS_KEPT:
            self._kept.popitem(last=False)
        return text

    def observation(
        self, history: list[Message], assistant: str, sampled_text: str, new: list[Message]
    ) -> tuple[list[int], bool]:
        """(tokens that follow the sampled ones: the close of the assistant turn, the new messages and the
        next generation prompt; whether the template was append-only here)."""
        before = self.render(history, True)
        closed = self.render([*history, {"role": "assistant", "content": assistant}], False)
        after = self.render([*history, {"role": "assistant", "content": assistant}, *new], True)
        prefixed = closed.startswith(before)
        turn = closed[len(before) :] if prefixed else closed
        content_close = _turn_close(turn, assistant)  # what the template writes after the content
        sampled_whole = turn.startswith(sampled_text)
        close = turn[len(sampled_text) :] if sampled_whole else content_close
        if after.startswith(closed):
            return self.tokenizer.encode(close + after[len(closed) :]), prefixed and sampled_whole
        # Not append-only: `after` re-rendered earlier turns. The new messages start after the assistant
        # turn's close, past the point where the two renders part.
        common = len(os.path.commonprefix([closed, after]))
        at = after.find(content_close, common) if content_close else -1
        new_part = after[at + len(content_close) :] if at >= 0 else after[common:]
        return self.tokenizer.encode(close + new_part), False


def _turn_close(rendered_turn: str, assistant: str) -> str:
    """What the template writes after the assistant's content in its rendered turn."""
    at = rendered_turn.rfind(assistant) if assistant else -1
    return rendered_turn[at + len(assistant) :] if at >= 0 else ""
