"""User code named in a config: `package.module:attr`, or a file's `path/to/file.py:attr` whose source the
driver read once (`config.loader`) and ships to every process that runs it (so the file need not exist there).

Shared by reward functions (rewards/base.py) and environments (envs/loader.py); imports nothing of dockrl.
`what` names the kind of object in error messages ("reward function", "environment").
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import types
from typing import Any


def import_attr(name: str, what: str) -> Any:
    """Attribute `attr` of `package.module:attr`; ValueError naming the module, its import error, or the
    callables it has."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {name!r} must be 'package.module:{_attr_word(what)}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is a config error
        raise ValueError(
            f"{what} {name!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    value = getattr(module, attr, None)
    if value is None:
        raise ValueError(
            f"{what} {name!r}: module {module_name!r} has no attribute {attr!r}; {_listing(module)}"
        )
    return value


def attr_from_code(name: str, code: str, origin: str, what: str) -> Any:
    """Attribute `attr` of `origin:attr` from the file's source `code`, run as a module of its own (under a
    name derived from the source, so every process gets the same module)."""
    attr = name.rpartition(":")[2]
    module_name = "dockrl_user_" + hashlib.sha1(code.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        module = types.ModuleType(module_name)
        module.__file__ = origin
        sys.modules[module_name] = module  # dataclasses and pickling look the module up while it runs
        try:
            exec(compile(code, origin, "exec"), module.__dict__)
        except Exception as exc:  # any failure of user code at import is a config error
            del sys.modules[module_name]
            raise ValueError(
                f"{what} {name!r}: importing {origin} failed: {type(exc).__name__}: {exc}"
            ) from exc
    value = getattr(module, attr, None)
    if value is None:
        raise ValueError(f"{what} {name!r}: {origin} has no {_attr_word(what)} {attr!r}; {_listing(module)}")
    return value


def _attr_word(what: str) -> str:
    return "class" if what == "environment" else "function"


def _listing(module: types.ModuleType) -> str:
    public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
    return f"callables: {public}"
