"""Build typed configs from YAML files and dotted `key=value` overrides.

    cfg = load_config(TrainConfig, "examples/grpo_tiny.yaml", ["run.steps=2", "actor.lr=1e-5"])

Unknown keys are errors that suggest the nearest valid key; values are checked against the field types
(`int`, `float`, `str`, `bool`, `Literal[...]` (closed choices: the error lists them), `X | None`,
`list[Dataclass]`, `dict`). No interpolation. A config is code, though: a reward function names a module to
import or a file whose source is read here and runs in every reward process (`code` runs only for a file
reference; README, "Rewards").
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from dockrl.config.fields import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Read a YAML file (optional), apply dotted overrides, and build a `cls` instance."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML config")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    for item in overrides or []:
        apply_override(raw, item)
    config = from_dict(cls, raw)
    search = ([Path(path).resolve().parent] if path is not None else []) + [Path.cwd()]
    reward = getattr(config, "reward", None)
    if reward is not None:
        read_reward_files(reward.functions, search)
    env = getattr(config, "env", None)
    if (
        env is not None
        and env.code is not None
        and (env.name is None or not names_a_file(env.name, env.source_file))
    ):
        raise ConfigError(
            f"env.code: set with env.name={env.name!r}, which is not a file reference; `code` runs only for "
            "'path/to/file.py:Class' (the loader fills it in): remove `code`"
        )
    if env is not None and env.name is not None and env.code is None:
        try:
            found = locate_reward_file(env.name, search, what="environment")
        except ValueError as exc:
            raise ConfigError(f"env.name={env.name!r}: {exc}") from exc
        if found is not None:
            env.source_file, env.code = str(found), found.read_text(encoding="utf-8")
    return config


def read_reward_files(functions: list, search_dirs: list[Path]) -> None:
    """Fill `source_file` and `code` of every reward function given as a file (`locate_reward_file`), so the
    driver ships its source to the workers; a file that is not there is a ConfigError naming it. Shipped `code`
    is accepted only for a name that refers to a file (`names_a_file`)."""
    for i, function in enumerate(functions):
        if function.code is not None:  # a saved run's config carries its file's code already
            if not names_a_file(function.name, function.source_file):
                raise ConfigError(
                    f"reward.functions[{i}].code: set with name={function.name!r}, which is not a file "
                    "reference; `code` runs only for 'path/to/file.py:function' (the loader fills it in): "
                    "remove `code`"
                )
            continue
        try:
            found = locate_reward_file(function.name, search_dirs)
        except ValueError as exc:
            raise ConfigError(f"reward.functions[{i}].name={function.name!r}: {exc}") from exc
        if found is not None:
            function.source_file, function.code = str(found), found.read_text(encoding="utf-8")


def names_a_file(name: str, origin: str | None = None) -> bool:
    """True when reward `name` refers to a source file, the only kind of name shipped `code` may stand for:
    `path/to/file.py:function`, or `module:function` read from `origin`, a file `.../module.py` (dots as
    folders), as `locate_reward_file` finds a module next to the config."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        return False
    if module.endswith(".py") or "/" in module or "\\" in module:
        return True
    return origin is not None and Path(origin).as_posix().endswith("/" + module.replace(".", "/") + ".py")


def locate_reward_file(name: str, search_dirs: list[Path], what: str = "reward function") -> Path | None:
    """The source file of reward function `name` when it is given as a file, else None.

    `path/to/file.py:function` names a file (relative paths are looked up in `search_dirs`, in order: the
    config file's directory, then the working directory). `module:function` names a file too when `module`
    does not import but `module.py` (dots as folders) lies in one of `search_dirs`, as a reward module next to
    the config does. Raises ValueError for a `.py` path found nowhere, naming where it looked.
    """
    module, sep, _ = name.partition(":")
    if not sep or not module:
        return None
    if module.endswith(".py") or "/" in module or "\\" in module:
        candidates = [Path(module)] if Path(module).is_absolute() else [d / module for d in search_dirs]
        for candidate in candidates:
            if candidate.is_file():
                return candidate.resolve()
        raise ValueError(
            f"{what} {name!r}: no file {module!r} in {[str(d) for d in search_dirs]} (paths are relative "
            "to the config file's directory, then the working directory)"
        )
    if importlib.util.find_spec(module.partition(".")[0]) is not None:
        return None  # importable as it is
    for directory in search_dirs:
        candidate = directory / (module.replace(".", "/") + ".py")
        if candidate.is_file():
            return candidate.resolve()
    return None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` override to a nested dict; the value is parsed as YAML (`1e-5`, `true`, `[1,2]`)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (for example run.steps=10)")
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({exc})") from exc
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a nested dict, checking keys and types; errors name the dotted key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(_unknown_key_message(prefix + key, list(fields), prefix))
    kwargs = {}
    for name, f in fields.items():
        key = prefix + name
        if name in raw:
            noun, choices = f.metadata.get("noun", "value"), f.metadata.get("choices")
            kwargs[name] = _coerce(hints[name], raw[name], key, noun, choices)
        elif dataclasses.is_dataclass(hints[name]) and f.default_factory is dataclasses.MISSING:
            kwargs[name] = from_dict(hints[name], {}, key + ".")  # names the missing leaf, e.g. model.path
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            doc = f.metadata.get("doc", "")
            raise ConfigError(f"{key} is required and missing; set it in the YAML or as {key}=... ({doc})")
    return cls(**kwargs)


def _unknown_key_message(key: str, valid: list[str], prefix: str) -> str:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.5)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"valid keys here: {', '.join(sorted(valid))}"
    return f"unknown config key {key!r}; {hint}"


def _coerce(
    tp: Any, value: Any, key: str, noun: str = "value", registered: Callable[[], tuple] | None = None
) -> Any:
    """`value` checked against type `tp`; `registered` gives a Literal's members when they register at run
    time (a setting's `choices`)."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp) if registered is None else registered()
        if value not in choices:
            raise ConfigError(f"{key}={value!r}: unknown {noun}; use one of {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key, noun, registered)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        section = typing.cast("type[DataclassInstance]", tp)  # a type hint: never an instance
        return from_dict(section, value if value is not None else {}, key + ".")
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(key, value, "a list")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(key, value, "a mapping")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(key, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(key, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `2e-5` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise _type_error(key, value, "a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _type_error(key, value, "a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _type_error(key, value, "a string")
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {key}")  # a schema bug, not a user error


def _type_error(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} has the wrong type ({type(value).__name__}); expected {expected}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (for config.yaml in the run directory)."""
    return dataclasses.asdict(cfg)


def render_docs(cls: type[DataclassInstance], prefix: str = "") -> list[str]:
    """Markdown table rows `| key | type | default | doc |` for every setting under `cls`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            section = typing.cast("type[DataclassInstance]", tp)  # a type hint: never an instance
            rows += render_docs(section, key + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        tp_name = str(tp).replace("typing.", "") if not isinstance(tp, type) else tp.__name__
        rows.append(f"| `{key}` | `{tp_name}` | `{default}` | {f.metadata.get('doc', '')} |")
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            rows += render_docs(typing.get_args(tp)[0], key + "[].")
    return rows
