"""The reward-function contract and name resolution.

A reward function scores one sample: ``fn(prompt, response, label) -> RewardResult | float``. It is
named either by a built-in name (``BUILTIN_REWARDS`` in ``builtin.py``) or by ``"package.module:function"``
for user code. A reward function may carry a ``warmup`` attribute, a no-argument callable that
RewardRunner runs once in each worker process at start-up, outside the per-call timeout (for heavy
imports or grammar compilation that would otherwise make the first call time out). A reward function may
also carry ``cheap = True``: it is fast and pure Python, and may run in the RewardRunner's own thread instead of
its process pool (reward.inline=cheap, the default); ``is_cheap`` says which resolved functions qualify. Extra
keyword arguments from the config are bound at resolution time, so a typo in them fails when the config is
built, not on the first sample.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from dockrl.config.loader import names_a_file
from dockrl.rewards.builtin import BUILTIN_REWARDS
from dockrl.rewards.result import RewardFn, RewardResult
from dockrl.user_code import attr_from_code, import_attr

__all__ = ["RewardFn", "RewardResult", "is_cheap", "resolve_reward_fn", "warmup_of"]


def warmup_of(fn: RewardFn) -> Callable[[], Any] | None:
    """The ``warmup`` callable of a reward function (looking through ``functools.partial``), if any."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    warmup = getattr(target, "warmup", None)
    return warmup if callable(warmup) else None


def is_cheap(fn: RewardFn) -> bool:
    """Whether a resolved reward function may run inline (reward.inline=cheap): it carries ``cheap = True``, and
    a built-in has no keyword arguments bound from the config (format's configured pattern is the user's regex,
    which can backtrack for ever while holding the GIL, beyond any in-process timeout)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    if getattr(target, "cheap", False) is not True:
        return False
    builtin = any(target is f for f in BUILTIN_REWARDS.values())
    return not (builtin and isinstance(fn, functools.partial))


def _import_function(name: str) -> Callable[..., Any]:
    fn = import_attr(name, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a callable")
    return fn


def _function_from_code(name: str, code: str, origin: str) -> Callable[..., Any]:
    """Attribute `function` of `origin:function` from the file's source `code` (dockrl.user_code)."""
    fn = attr_from_code(name, code, origin, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: {origin} has no function {name.rpartition(':')[2]!r}")
    return fn


def resolve_reward_fn(
    name: str, kwargs: dict | None = None, code: str | None = None, origin: str | None = None
) -> RewardFn:
    """Return the reward function called ``name`` with ``kwargs`` bound.

    Args:
        name: a built-in name ("exact_answer", "math_verify", "format"), "package.module:function", or a
            file's "path/to/file.py:function" (whose source is `code`).
        kwargs: extra keyword arguments passed on every call (e.g. ``{"pattern": ...}`` for "format").
        code: the source of the reward's file, read once by the driver (`config.loader.locate_reward_file`) and
            shipped to every worker and reward process, so the file need not exist where they run. Only with a
            `name` that refers to a file (`config.loader.names_a_file`): a built-in or importable name never
            runs shipped code.
        origin: that file's path, for tracebacks and errors.

    Raises:
        ValueError: unknown built-in (lists the built-ins), module that fails to import (names the path
            and the import error), missing attribute, kwargs the function does not accept, or `code` with a
            name that is not a file's.
    """
    if code is not None:
        if not names_a_file(name, origin):
            raise ValueError(
                f"reward function {name!r} comes with `code`, which runs only for a file reference "
                "('path/to/file.py:function'); a built-in or importable name runs what it names: remove `code` "
                "(the loader fills it in from the file)"
            )
        fn = _function_from_code(name, code, origin or name.rpartition(":")[0])
    elif ":" in name:
        fn = _import_function(name)
    else:
        builtins = BUILTIN_REWARDS
        if name not in builtins:
            raise ValueError(
                f"unknown reward function {name!r}; built-ins are {sorted(builtins)}, "
                "or give user code as 'package.module:function'"
            )
        fn = builtins[name]
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind("prompt", "response", "label", **kwargs)
    except TypeError as exc:
        raise ValueError(
            f"reward function {name!r} cannot be called as fn(prompt, response, label, **{kwargs}): {exc}"
        ) from exc
    except ValueError:
        pass  # no introspectable signature (some builtins / C functions): trust the caller
    return functools.partial(fn, **kwargs) if kwargs else fn
