"""Versioned JSON round trips for the frozen dataclasses that cross stage boundaries.

Each boundary type declares ``SCHEMA`` (its name) and ``VERSION``; the JSON carries both, and
loading a file of another schema or a newer version is a clear error rather than a KeyError later.
Nested dataclasses, tuples, dicts and Optionals are rebuilt from the type hints.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from planner.errors import BadInput

T = TypeVar("T")


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def _build(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(args[0], value) if len(args) == 1 else value
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        return tp(**{k: _build(hints[k], v) for k, v in value.items() if k in names})
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value))
    if origin is list:
        (arg,) = typing.get_args(tp)
        return [_build(arg, v) for v in value]
    if origin is dict:
        _, vt = typing.get_args(tp)
        return {k: _build(vt, v) for k, v in value.items()}
    return value


def from_jsonable(cls: type[T], data: dict, *, source: str = "input") -> T:
    schema, version = getattr(cls, "SCHEMA"), getattr(cls, "VERSION")
    if not isinstance(data, dict) or data.get("schema") != schema:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise BadInput(f"{source}: not a {schema} file (schema: {got!r})")
    if not isinstance(data.get("version"), int) or data["version"] > version:
        raise BadInput(
            f"{source}: {schema} version {data.get('version')!r} is newer than this tool reads "
            f"({version}); upgrade the planner"
        )
    try:
        return _build(cls, data)
    except (TypeError, KeyError, AttributeError) as exc:
        raise BadInput(f"{source}: malformed {schema} file: {exc}") from exc


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=2)


def load_json_file(cls: type[T], path: str | Path) -> T:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise BadInput(f"{path}: no such file") from exc
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from exc
    return from_jsonable(cls, data, source=str(path))


def write_new_file(path: str | Path, text: str, *, force: bool = False) -> Path:
    """Write `text` to `path`, refusing to replace an existing file unless `force`."""
    path = Path(path)
    if path.exists() and not force:
        raise BadInput(f"{path}: already exists; pass --force to overwrite it")
    if not path.parent.exists():
        raise BadInput(f"{path.parent}: no such directory")
    path.write_text(text + ("" if text.endswith("\n") else "\n"))
    return path


class Versioned:
    """JSON methods for a boundary dataclass that declares SCHEMA and VERSION."""

    def to_json(self) -> str:
        return dumps(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "input"):
        return from_jsonable(cls, data, source=source)

    @classmethod
    def load(cls, path):
        return load_json_file(cls, path)
