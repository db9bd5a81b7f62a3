"""Leaf checks shared by the config rules: a positive number. Raises ConfigError naming the setting, the value
and the fix. (The checks that read files, a model directory and a dataset, are in recipes/preflight.py.)"""

from __future__ import annotations

from dockrl.config.fields import config_error


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    """`value` of setting `key` is > 0 (>= 1 for an int), or >= 0 with `allow_zero`."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1" if isinstance(value, int) else "> 0"
        raise config_error(key, value, f"must be {bound}", f"set {key} to a value {bound}")
