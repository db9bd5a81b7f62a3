"""`env.name` -> a factory of fresh environments (one per trajectory).

    tools                       the built-in ToolEnvironment (env.kwargs: {tools: [calculator, python]})
    package.module:Class        an importable class
    path/to/file.py:Class       a file's class; its source is read when the config is loaded and shipped
                                (env.code), so it need not exist on the rollout nodes
    path/to/agent.py:solve      an agent function, `async def solve(client, row) -> float | None`, written
    package.module:solve        against the `openai` client (docs/agents.md): not an environment class, it
                                runs on serve/agent_host.py's AgentHost (agent_function says which)

A class is built as `Class(**env.kwargs)`; where its constructor takes `family`, `call_timeout_s` or
`allow_unsandboxed` (a ToolEnvironment subclass does), the rollout passes the model family, env.call_timeout_s
and env.allow_unsandboxed too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from dockrl.envs.base import Environment
from dockrl.envs.tool_env import ToolEnvironment
from dockrl.user_code import attr_from_code, import_attr

BUILTIN_ENVS: dict[str, type] = {"tools": ToolEnvironment}


def _named(name: str, code: str | None, origin: str | None) -> Any:
    """What env.name names: a built-in, a file's attribute (its shipped source) or a module's."""
    if code is not None:
        if not name.partition(":")[0].endswith(".py") and not (origin or "").endswith(".py"):
            raise ValueError(
                f"environment {name!r} comes with source code but names no file (path/to/file.py:Class)"
            )
        return attr_from_code(name, code, origin or name.rpartition(":")[0], "environment")
    if ":" in name:
        return import_attr(name, "environment")
    if name in BUILTIN_ENVS:
        return BUILTIN_ENVS[name]
    raise ValueError(
        f"unknown environment {name!r}; built-ins are {sorted(BUILTIN_ENVS)}, or name a class as "
        "'package.module:Class' or 'path/to/file.py:Class', or an agent function 'path/to/agent.py:solve'"
    )


def env_class(name: str, code: str | None = None, origin: str | None = None) -> type:
    """The class `name` names (module docstring); ValueError naming what is wrong."""
    cls = _named(name, code, origin)
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ValueError(
            f"environment {name!r} is not a class with reset(row) and step(message) methods, nor an agent "
            "function (`async def solve(client, row)`)"
        )
    return cls


def agent_function(name: str, code: str | None = None, origin: str | None = None) -> Callable | None:
    """The agent function `name` names (an `async def` taking (client, row)), or None when it names anything
    else (an environment class: env_class checks it)."""
    named = _named(name, code, origin)
    if inspect.isclass(named) or not inspect.iscoroutinefunction(named):
        return None
    if len(inspect.signature(named).parameters) < 2:
        raise ValueError(f"agent function {name!r} must take (client, row)")
    return named


def is_agent(env: Any) -> bool:
    """Whether a run's environment (an EnvSpec) is an agent function."""
    return agent_function(env.name, env.code, env.origin) is not None


def env_factory(
    name: str,
    kwargs: dict[str, Any] | None = None,
    *,
    code: str | None = None,
    origin: str | None = None,
    family: str = "qwen2",
    call_timeout_s: float = 10.0,
    allow_unsandboxed: bool = False,
) -> Callable[[], Environment]:
    """A callable that builds a fresh environment; builds one now, so bad kwargs fail here, naming them."""
    cls = env_class(name, code, origin)
    arguments = dict(kwargs or {})
    accepted = inspect.signature(cls).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    for key, value in (
        ("family", family),
        ("call_timeout_s", call_timeout_s),
        ("allow_unsandboxed", allow_unsandboxed),
    ):
        if key in accepted or takes_all:
            arguments.setdefault(key, value)

    def make() -> Environment:
        env = cls(**arguments)
        if not isinstance(getattr(env, "tools", []), list):
            raise ValueError(f"environment {name!r}: `tools` must be a list of JSON schemas")
        return env

    try:
        make()
    except TypeError as exc:
        raise ValueError(
            f"environment {name!r} cannot be built as {cls.__name__}(**{kwargs}): {exc}"
        ) from exc
    return make


def env_tools(env: Environment) -> list[dict[str, Any]]:
    """The JSON schemas an environment's tools declare ([] when it has none)."""
    return list(getattr(env, "tools", None) or [])


def factory_of(env: Any, family: str) -> Callable[[], Environment]:
    """The environment factory of a run's environment `env` (an EnvSpec: name, kwargs, its file's code and
    origin, call_timeout_s) for a model of `family`: the one way the driver, the preflight and the rollout build
    it."""
    return env_factory(
        env.name,
        env.kwargs,
        code=env.code,
        origin=env.origin,
        family=family,
        call_timeout_s=env.call_timeout_s,
        allow_unsandboxed=env.allow_unsandboxed,
    )
