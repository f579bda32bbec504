"""Loading a config: YAML and `--set key=value` into the schema's dataclasses, strictly. An
unknown key is an error that suggests the nearest valid key; a value of the wrong type names the
key and what is allowed. Every loaded config is range-checked (config.checks)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from megatronish.config.checks import check_values
from megatronish.config.presets import with_preset
from megatronish.config.schema import Config, key_of
from megatronish.errors import UserError


def _nearest(name: str, options: list[str], prefix: str) -> str:
    full = [f"{prefix}.{o}" if prefix else o for o in options]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{full[options.index(close[0])]}'?"
    return "valid keys: " + ", ".join(full)


@functools.cache
def _field_types(cls) -> Mapping[str, Any]:
    """Config key -> type of each field of cls (schema.key_of: the field `async_` is `async`).
    Once per class: get_type_hints evaluates every annotation's string again at each call."""
    hints = typing.get_type_hints(cls)
    return types.MappingProxyType({key_of(f.name): hints[f.name] for f in dataclasses.fields(cls)})


def _field_name(cls, key: str) -> str:
    """The field of cls that holds config key `key`."""
    return next(f.name for f in dataclasses.fields(cls) if key_of(f.name) == key)


def _nullable_section(tp: Any) -> Any:
    """The dataclass of a field typed `Section | None` (a section that may be null, such as
    model.rope_scaling), else None."""
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts) + " or null"
    return {
        int: "an integer",
        float: "a finite number",
        bool: "true or false",
        str: "a string",
    }.get(tp, str(tp))


def _coerce(key: str, value: Any, tp: Any, from_string: bool) -> Any:
    """value as type tp, or a UserError naming key and what is allowed."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (from_string and str(value).lower() in ("null", "none", "~")):
            return None
        if isinstance(value, list) and list in inner and not from_string:
            return value  # a YAML list (data.blend); its items are checked where it is used
        return _coerce(key, value, inner[0], from_string)
    if origin is list:
        return _as_list(key, value, get_args(tp)[0], from_string)
    if origin is Literal:
        allowed = get_args(tp)
        if from_string and all(isinstance(a, int) for a in allowed):
            try:
                value = int(value)
            except ValueError:
                pass
        if value not in allowed:
            raise UserError(f"{key}: {value!r} is not valid; valid: {_describe(tp)}")
        return value
    bad = UserError(f"{key}: {value!r} is not {_describe(tp)}")
    if tp is bool:
        return _as_bool(value, from_string, bad)
    if tp is int:
        return _as_int(value, bad)
    if tp is float:
        return _as_float(value, bad)
    if tp is str:
        if value is None:
            raise UserError(f"{key}: null is not valid; expected a string")
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    raise bad


def _as_list(key: str, value: Any, item: Any, from_string: bool) -> list:
    """A YAML list (from --set, a flow sequence such as [a, b]) of items of type item, each
    coerced as key[i]; else a UserError naming key."""
    if from_string:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass
    if not isinstance(value, list):
        raise UserError(f"{key}: {value!r} is not a list of {_describe(item)}")
    return [_coerce(f"{key}[{index}]", entry, item, False) for index, entry in enumerate(value)]


def _as_bool(value: Any, from_string: bool, bad: UserError) -> bool:
    """A YAML bool, or from --set true/false, yes/no, 1/0; else `bad`."""
    if isinstance(value, bool):
        return value
    if from_string and str(value).lower() in ("true", "false", "yes", "no", "1", "0"):
        return str(value).lower() in ("true", "yes", "1")
    raise bad


def _as_int(value: Any, bad: UserError) -> int:
    """An integer, a float or string of a whole number (1e3) as one; else `bad` (a bool too)."""
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            try:
                as_float = float(value)
            except ValueError:
                raise bad from None
            if as_float.is_integer():
                return int(as_float)
    raise bad


def _as_float(value: Any, bad: UserError) -> float:
    """A finite number (a string of one too) as a float; else `bad` (a bool, YAML .nan, .inf,
    a whole number too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    try:
        result = float(value)
    except (ValueError, OverflowError):
        raise bad from None
    if math.isfinite(result):
        return result
    raise bad


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise UserError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in types_:
            raise UserError(f"unknown key '{dotted}'; {_nearest(str(key), sorted(types_), prefix)}")
        tp = types_[key]
        name = _field_name(cls, key)
        section = _nullable_section(tp)
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, dotted)
        elif section is not None:
            kwargs[name] = None if value is None else _build(section, value, dotted)
        else:
            kwargs[name] = _coerce(dotted, value, tp, from_string=False)
    return cls(**kwargs)


def _apply_override(cfg: Config, assignment: str) -> None:
    if "=" not in assignment:
        raise UserError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.steps=20")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    target: Any = cfg
    for depth, part in enumerate(parts):
        types_ = _field_types(type(target))
        seen = ".".join(parts[:depth])
        if part not in types_:
            where = f"'{seen}.{part}'" if seen else f"'{part}'"
            raise UserError(f"--set: unknown key {where}; {_nearest(part, sorted(types_), seen)}")
        tp, name = types_[part], _field_name(type(target), part)
        section = _nullable_section(tp)
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise UserError(f"--set {key}: is a section; set one of its keys, e.g. {key}.x=...")
            if section:
                setattr(target, name, _nullable_section_value(key, raw, section))
            else:
                setattr(target, name, _coerce(key, raw, tp, True))
        else:
            if not (dataclasses.is_dataclass(tp) or section):
                raise UserError(f"--set {key}: '{'.'.join(parts[: depth + 1])}' has no sub-keys")
            if section and getattr(target, name) is None:  # a null section, now set key by key
                setattr(target, name, section())
            target = getattr(target, name)


def _nullable_section_value(key: str, raw: str, section: Any) -> Any:
    """`--set KEY=null` or `--set KEY={k: v, ...}` (a YAML mapping) of a section that may be
    null, as None or the section."""
    if raw.strip().lower() in ("null", "none", "~"):
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if not isinstance(value, dict):
        raise UserError(
            f"--set {key}: {raw!r} is not valid; expected null, a YAML mapping such as "
            f"'{{key: value, ...}}', or one key at a time ({key}.KEY=VALUE)"
        )
    return _build(section, value, key)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of YAML file `path` (None: defaults) with `--set` overrides applied, checked."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise UserError(f"config file {path}: is a directory; give a YAML file (see configs/)")
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise UserError(f"config file {path}: not valid YAML{where}") from None
        except UnicodeDecodeError:
            raise UserError(f"config file {path}: not a text file") from None
    cfg = _build(Config, _with_arch_preset(data, overrides), "")
    for assignment in overrides:
        _apply_override(cfg, assignment)
    check_values(cfg)
    return cfg


def _with_arch_preset(data: Any, overrides: list[str] | tuple[str, ...]) -> Any:
    """The YAML data with model.arch's preset filling the model keys it leaves unset, for the
    arch that wins (the last --set model.arch=..., else the file's), and the attention that
    wins (the last --set model.attention=..., if any) deciding whether its model.mla sizes
    apply; --set keys win over it as they are applied after."""
    if not isinstance(data, dict):
        return data
    model = data.get("model") or {}
    arch = model.get("arch", "gpt2") if isinstance(model, dict) else "gpt2"
    attention = None
    for assignment in overrides:
        key, _, value = assignment.partition("=")
        if key.strip() == "model.arch":
            arch = value.strip()
        elif key.strip() == "model.attention":
            attention = value.strip()
    if not isinstance(arch, str):  # not an arch at all: the loader names the key
        return data
    return {**data, "model": with_preset(model, arch, attention)}


def config_from_dict(data: dict[str, Any]) -> Config:
    """A Config from a dict such as Config.to_dict() wrote (a checkpoint's resolved config)."""
    cfg = _build(Config, data, "")
    check_values(cfg)
    return cfg
