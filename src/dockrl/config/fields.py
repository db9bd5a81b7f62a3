"""Helpers to declare documented config fields and to word config errors (ConfigError itself lives in
dockrl/errors.py, importable from every layer; it is re-exported here and from dockrl.config).

Every setting is declared once, as a dataclass field with its help text in ``metadata["doc"]``; the
documentation (``dockrl config-docs``) is rendered from those declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dockrl.errors import ConfigError

__all__ = ["ConfigError", "config_error", "required", "setting"]


def required(doc: str) -> Any:
    """A setting without a default: the config must give it."""
    return dataclasses.field(metadata={"doc": doc})


def setting(
    default: Any, doc: str, noun: str = "value", choices: Callable[[], tuple[str, ...]] | None = None
) -> Any:
    """A setting with a default (mutable defaults are copied per instance); `noun` names what a closed
    choice (`Literal[...]`) is in its error: "algo.kl_estimator='k7': unknown estimator; use one of ...".
    `choices`: for a choice whose members register at run time (algo.adv_estimator), what the loader accepts,
    asked when a config is loaded, instead of the `Literal`'s declared members."""
    metadata: dict[str, Any] = {"doc": doc, "noun": noun}
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def config_error(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    """Build the standard message: `key=value: problem; fix`."""
    return ConfigError(f"{key}={value!r}: {problem}; {fix}")
