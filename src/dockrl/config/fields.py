"""Helpers to declare documented config fields, and the config error type.

Every setting is declared once, as a dataclass field with its help text in ``metadata["doc"]``; the
documentation (``dockrl config-docs``) is rendered from those declarations.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A user error in a config: the message names the setting, the value and the fix."""


def required(doc: str) -> Any:
    """A setting without a default: the config must give it."""
    return dataclasses.field(metadata={"doc": doc})


def setting(default: Any, doc: str) -> Any:
    """A setting with a default (mutable defaults are copied per instance)."""
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def config_error(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    """Build the standard message: `key=value: problem; fix`."""
    return ConfigError(f"{key}={value!r}: {problem}; {fix}")
