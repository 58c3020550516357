"""Versioned JSON round trips for the frozen dataclasses that cross stage boundaries.

Each boundary type declares ``SCHEMA`` (its name) and ``VERSION``; the JSON carries both, and
loading a file of another schema or a newer version is a clear error rather than a KeyError later.
Nested dataclasses, tuples, dicts and Optionals are rebuilt from the type hints and checked
against them: a missing required field or a value of the wrong type is one line naming the file
and the field's dotted path (``plan.json: parallel.dp is missing``); fields with defaults may be
absent (files written before they existed). A schema may add checks across fields (`CHECKS`:
a plan's degrees must multiply to its GPU count, ...). Writing goes through `planner.files`
(atomic, the path checked first).
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


class _Malformed(Exception):
    """A field of the file that is missing or of the wrong type: `where` is its dotted path."""

    def __init__(self, where: str, message: str):
        """`message` about the field at `where`: "parallel.dp: expected ..."; one that starts with
        a space reads after the path ("parallel.dp is missing")."""
        sep = "" if message.startswith(" ") or not where else ": "
        super().__init__(f"{where}{sep}{message}")


def _join(where: str, name: str | int) -> str:
    if isinstance(name, int):
        return f"{where}[{name}]"
    return f"{where}.{name}" if where else name


def _shown(value: Any) -> str:
    """A JSON value as the file spells it, shortened."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_WHAT = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


def _build(tp: Any, value: Any, where: str = "") -> Any:
    """`value` (parsed JSON) as type `tp`, checked against it: _Malformed names the first field
    that is missing or of the wrong type by its dotted path (``stages[1].memory_bytes.total``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(tp)):
                return None
            raise _Malformed(where, f"expected {_what(tp)}, got null")
        return _build(args[0], value, where) if len(args) == 1 else value
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Malformed(where, f"expected an object, got {_shown(value)}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            if f.name in value:
                kwargs[f.name] = _build(hints[f.name], value[f.name], _join(where, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Malformed(_join(where, f.name), " is missing")
        return tp(**kwargs)
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise _Malformed(where, f"expected a list, got {_shown(value)}")
        args = typing.get_args(tp)
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            items = [_build(args[0] if args else Any, v, _join(where, i)) for i, v in enumerate(value)]
        else:
            if len(value) != len(args):
                raise _Malformed(where, f"expected a list of {len(args)}, got {_shown(value)}")
            items = [_build(a, v, _join(where, i)) for i, (a, v) in enumerate(zip(args, value))]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise _Malformed(where, f"expected an object, got {_shown(value)}")
        args = typing.get_args(tp)
        vt = args[1] if args else Any
        return {k: _build(vt, v, _join(where, k)) for k, v in value.items()}
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    else:
        return value
    if not ok:
        raise _Malformed(where, f"expected {_WHAT[tp]}, got {_shown(value)}")
    return value


def _what(tp: Any) -> str:
    """What a type expects, in words (for `null` where a value is required)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    inner = args[0] if len(args) == 1 else tp
    if dataclasses.is_dataclass(inner) or typing.get_origin(inner) is dict:
        return "an object"
    if typing.get_origin(inner) in (tuple, list):
        return "a list"
    return _WHAT.get(inner, "a value")


def _one_of(where: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise _Malformed(where, f"{_shown(value)} is not one of {', '.join(map(str, allowed))}")


def _at_least(where: str, value: int, low: int = 1) -> None:
    if value < low:
        raise _Malformed(where, f"must be at least {low}, got {value}")


def check_plan(plan: Any) -> None:
    """What a planner.Plan must satisfy beyond its field types, so that `plan run` never meets a
    plan it cannot launch: positive degrees that multiply to the GPU count, one stage per pipeline
    rank, micro-batches that make up the global batch, known schedule, recompute, ZeRO stage,
    precision and optimizer. _Malformed names the field or the constraint."""
    from planner.cost.setup import EP_DISPATCHES, OPTIMIZERS, PRECISIONS, RECOMPUTE, SCHEDULES, TRAINERS

    p, cluster, training = plan.parallel, plan.cluster, plan.training
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "num_microbatches", "virtual_stages", "dp_replicate"):
        _at_least(f"parallel.{name}", getattr(p, name))
    _at_least("cluster.num_gpus", cluster.num_gpus)
    _at_least("cluster.gpus_per_node", cluster.gpus_per_node)
    _at_least("training.global_batch", training.global_batch)
    _one_of("parallel.zero", p.zero, (0, 1, 2, 3))
    _one_of("parallel.schedule", p.schedule, SCHEDULES)
    _one_of("parallel.recompute", p.recompute, (*RECOMPUTE, "mixed"))
    _one_of("training.precision", training.precision, PRECISIONS)
    _one_of("training.optimizer", training.optimizer, OPTIMIZERS)
    _one_of("training.trainer", training.trainer, tuple(TRAINERS))
    _one_of("training.ep_dispatch", training.ep_dispatch, EP_DISPATCHES)
    if training.expert_node_limit is not None:
        _at_least("training.expert_node_limit", training.expert_node_limit)
    if p.world_size != cluster.num_gpus:
        cp = f" x cp {p.cp}" if p.cp > 1 else ""
        raise _Malformed(
            "parallel",
            f"dp {p.dp} x tp {p.tp} x pp {p.pp}{cp} = {p.world_size}, not cluster.num_gpus {cluster.num_gpus}",
        )
    if p.stage_ranks % p.ep:
        raise _Malformed("parallel", f"ep {p.ep} does not divide dp x cp x tp {p.stage_ranks}")
    if p.dp % p.dp_replicate:
        raise _Malformed("parallel", f"dp_replicate {p.dp_replicate} does not divide dp {p.dp}")
    if p.micro_batch * p.num_microbatches * p.dp != training.global_batch:
        raise _Malformed(
            "parallel",
            f"micro_batch {p.micro_batch} x num_microbatches {p.num_microbatches} x dp {p.dp} = "
            f"{p.micro_batch * p.num_microbatches * p.dp}, not training.global_batch {training.global_batch}",
        )
    if tuple(layer.name for layer in plan.model.layers) != tuple(plan.model.layer_names):
        raise _Malformed("model.layers", "their names differ from model.layer_names")
    if len(plan.stages) != p.pp:
        raise _Malformed("stages", f"{len(plan.stages)} stage{'s' * (len(plan.stages) != 1)}, not parallel.pp {p.pp}")
    for i, stage in enumerate(plan.stages):
        if stage.rank != i:
            raise _Malformed(f"stages[{i}].rank", f"expected {i}, got {stage.rank}")


CHECKS: dict[str, typing.Callable[[Any], None]] = {"planner.Plan": check_plan}
"""Per schema: the checks across fields that a loaded file must pass (raising _Malformed)."""


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
    oldest = getattr(cls, "OLDEST", 1)
    if data["version"] < oldest:
        raise BadInput(
            f"{source}: {schema} version {data['version']} was written by an older planner; this tool "
            f"reads versions {oldest} to {version}: make it again"
        )
    try:
        obj = _build(cls, data)
        check = CHECKS.get(schema)
        if check is not None:
            check(obj)
        return obj
    except _Malformed as exc:
        raise BadInput(f"{source}: {exc}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise BadInput(f"{source}: malformed {schema} file: {exc}") from exc


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=2)


def load_json_file(cls: type[T], path: str | Path) -> T:
    """Read a versioned JSON file; BadInput (one line naming the file) when it is missing,
    unreadable, not UTF-8, not JSON, or not a valid `cls`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise BadInput(f"{path}: no such file") from exc
    except IsADirectoryError as exc:
        raise BadInput(f"{path}: is a directory, not a {cls.SCHEMA} file") from exc
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadInput(
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); expected a {cls.SCHEMA} JSON file"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise BadInput(f"{path}: not valid JSON: nested too deeply") from None
    return from_jsonable(cls, data, source=str(path))


def write_new_file(path: str | Path, text: str, *, force: bool = False, flag: str | None = None) -> Path:
    """Write `text` to `path` atomically (planner.files), refusing to replace an existing file
    unless `force`, and a path that is a directory or whose directory is missing or unwritable."""
    from planner.files import atomic_write_text, check_output_path

    check_output_path(path, force=force, flag=flag)
    return atomic_write_text(path, text + ("" if text.endswith("\n") else "\n"))


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
