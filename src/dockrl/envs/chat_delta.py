"""Observation tokens as the chat template's delta (engines/rollout/multi_turn.py's module docstring): what follows
the sampled tokens of an assistant turn, rendered once and encoded on its own. Pure Python (no torch): the
rollout and the agent host (serve/agent_host.py) share it.
"""

from __future__ import annotations

import os
from typing import Any

from dockrl.envs.base import Message


class ChatDelta:
    """Observation tokens as the chat template's delta (module docstring). `tokenizer` has
    apply_chat_template(messages, add_generation_prompt=..., tools=...), encode(text) and decode(ids,
    skip_special_tokens=...)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]):
        self.tokenizer, self.tools = tokenizer, tools or None

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tools=self.tools
        )

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
