"""Leaf checks shared by the config validators and the CLI: a positive number, a model directory, a dataset file.
Each raises ConfigError naming the setting, the value and the fix."""

from __future__ import annotations

from pathlib import Path

from dockrl.config.fields import config_error


def check_model_dir(path: str, key: str) -> None:
    """A model directory must exist and hold config.json."""
    p = Path(path)
    if not p.is_dir():
        raise config_error(
            key,
            path,
            "the model directory does not exist",
            "pass a Hugging Face checkpoint directory (build a tiny one with `dockrl make-tiny DIR`)",
        )
    if not (p / "config.json").is_file():
        raise config_error(
            key, path, "the directory has no config.json", "pass a Hugging Face checkpoint directory"
        )


def check_dataset(path: str, prompt_field: str, label_field: str | None, key: str) -> None:
    """The dataset file must exist and its first row must hold the prompt (and label) field."""
    from dockrl.data.datasets import load_prompts

    if not Path(path).is_file():
        raise config_error(key, path, "the dataset file does not exist", "pass a .jsonl or .parquet file")
    load_prompts(path, prompt_field=prompt_field, label_field=label_field, limit=1)


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1" if isinstance(value, int) else "> 0"
        raise config_error(key, value, f"must be {bound}", f"set {key} to a value {bound}")
