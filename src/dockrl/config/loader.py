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
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dockrl.config.fields import ConfigError

T = TypeVar("T")


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
    reward = getattr(config, "reward", None)
    if reward is not None:
        search = ([Path(path).resolve().parent] if path is not None else []) + [Path.cwd()]
        read_reward_files(reward.functions, search)
    return config


def read_reward_files(functions: list, search_dirs: list[Path]) -> None:
    """Fill `source_file` and `code` of every reward function given as a file (rewards.base.locate_reward_file),
    so the driver ships its source to the workers; a file that is not there is a ConfigError naming it."""
    from dockrl.rewards.base import locate_reward_file, names_a_file

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
            kwargs[name] = _coerce(hints[name], raw[name], key, f.metadata.get("noun", "value"))
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


def _coerce(tp: Any, value: Any, key: str, noun: str = "value") -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
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
                return _coerce(arg, value, key, noun)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, key + ".")
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


def render_docs(cls: type, prefix: str = "") -> list[str]:
    """Markdown table rows `| key | type | default | doc |` for every setting under `cls`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += render_docs(tp, key + ".")
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
