"""Prompt datasets, prompt rendering and synthetic tasks (no torch, no Ray)."""

from dockrl.data.datasets import DatasetError, PromptRecord, load_prompts, render_prompt
from dockrl.data.synthetic import TASKS, arithmetic_rows, write_jsonl, write_task

__all__ = [
    "TASKS",
    "DatasetError",
    "PromptRecord",
    "arithmetic_rows",
    "load_prompts",
    "render_prompt",
    "write_jsonl",
    "write_task",
]
