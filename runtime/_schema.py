"""Field schemas for message dataclasses: the one place where wire types are checked.

Every message and record is a frozen, slotted dataclass. At class creation we
turn its annotations into a small tuple of checkers, so construction checks
types cheaply (adverts arrive thousands per second) and decoding can rebuild
nested records and tuples from plain msgpack values without per-class code.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Union

import numpy as np

from .errors import LocalViolation, RemoteViolation

__all__ = ["Record", "FieldSpec", "schema_of", "from_wire", "to_wire"]

# A checker validates a python value (raising RemoteViolation) and a builder
# turns a wire value (msgpack-decoded) into the python value.
Checker = Callable[[Any, str], None]
Builder = Callable[[Any, str], Any]


class Record:
    """Mixin marking a dataclass whose fields are checked against its annotations."""

    __slots__ = ()
    _fields: ClassVar[tuple[FieldSpec, ...]]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # each subclass's @dataclass

    def __post_init__(self) -> None:
        for spec in type(self)._fields:
            spec.check(getattr(self, spec.name), spec.name)
        validate = getattr(self, "validate", None)
        if validate is not None:
            validate()


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    check: Checker
    build: Builder
    required: bool


def _fail(path: str, want: str, got: Any) -> RemoteViolation:
    return RemoteViolation(f"field {path!r}: expected {want}, got {type(got).__name__}")


def _scalar(kind: type, want: str) -> tuple[Checker, Builder]:
    def check(v: Any, path: str) -> None:
        if kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind is float:
            ok = isinstance(v, float)
        else:
            ok = isinstance(v, kind)
        if not ok:
            raise _fail(path, want, v)

    def build(v: Any, path: str) -> Any:
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        return v

    return check, build


def _ndarray() -> tuple[Checker, Builder]:
    def check(v: Any, path: str) -> None:
        if not isinstance(v, np.ndarray):
            raise _fail(path, "ndarray", v)

    return check, lambda v, path: v


def _compile(tp: Any) -> tuple[Checker, Builder]:
    origin = typing.get_origin(tp)
    if tp is str:
        return _scalar(str, "str")
    if tp is int:
        return _scalar(int, "int")
    if tp is float:
        return _scalar(float, "float")
    if tp is bool:
        return _scalar(bool, "bool")
    if tp is bytes:
        return _scalar(bytes, "bytes")
    if tp is np.ndarray:
        return _ndarray()
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise LocalViolation(f"unsupported union {tp}")
        inner_check, inner_build = _compile(args[0])

        def check_opt(v: Any, path: str) -> None:
            if v is not None:
                inner_check(v, path)

        def build_opt(v: Any, path: str) -> Any:
            return None if v is None else inner_build(v, path)

        return check_opt, build_opt
    if origin is tuple:
        items = typing.get_args(tp)
        if len(items) != 2 or items[1] is not Ellipsis:
            raise LocalViolation(f"only tuple[X, ...] is supported, not {tp}")
        item_check, item_build = _compile(items[0])

        def check_tuple(v: Any, path: str) -> None:
            if not isinstance(v, tuple):
                raise _fail(path, "tuple", v)
            for i, item in enumerate(v):
                item_check(item, f"{path}[{i}]")

        def build_tuple(v: Any, path: str) -> Any:
            if not isinstance(v, (list, tuple)):
                raise _fail(path, "array", v)
            return tuple(item_build(item, f"{path}[{i}]") for i, item in enumerate(v))

        return check_tuple, build_tuple
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if key_t is not str:
            raise LocalViolation(f"only str keys are supported, not {tp}")
        val_check, val_build = _compile(val_t)

        def check_dict(v: Any, path: str) -> None:
            if not isinstance(v, dict):
                raise _fail(path, "map", v)
            for k, item in v.items():
                if not isinstance(k, str):
                    raise _fail(f"{path}.<key>", "str", k)
                val_check(item, f"{path}.{k}")

        def build_dict(v: Any, path: str) -> Any:
            if not isinstance(v, dict):
                raise _fail(path, "map", v)
            return {k: val_build(item, f"{path}.{k}") for k, item in v.items()}

        return check_dict, build_dict
    if isinstance(tp, type) and issubclass(tp, Record):
        rec = tp

        def check_rec(v: Any, path: str) -> None:
            if not isinstance(v, rec):
                raise _fail(path, rec.__name__, v)

        def build_rec(v: Any, path: str) -> Any:
            if not isinstance(v, dict):
                raise _fail(path, "map", v)
            return from_wire(rec, v, path)

        return check_rec, build_rec
    raise LocalViolation(f"unsupported field type {tp!r}")


def schema_of(cls: type[Record]) -> tuple[FieldSpec, ...]:
    """Compile (once) and attach the field specs of a Record dataclass."""
    hints = typing.get_type_hints(cls, include_extras=False)
    specs = []
    for f in dataclasses.fields(cls):
        check, build = _compile(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(FieldSpec(f.name, check, build, required))
    cls._fields = tuple(specs)
    return cls._fields


R = TypeVar("R", bound=Record)


def from_wire(cls: type[R], data: dict[str, Any], path: str = "") -> R:
    """Build ``cls`` from a decoded map; unknown keys are ignored (forward compatible)."""
    kwargs = {}
    for spec in cls._fields:
        if spec.name in data:
            kwargs[spec.name] = spec.build(data[spec.name], f"{path}{spec.name}" if not path else f"{path}.{spec.name}")
        elif spec.required:
            raise RemoteViolation(f"{cls.__name__}: missing field {spec.name!r}")
    return cls(**kwargs)


def to_wire(value: Any) -> Any:
    """Plain msgpack-able structure for a record (arrays stay arrays for the codec)."""
    if isinstance(value, Record):
        return {spec.name: to_wire(getattr(value, spec.name)) for spec in type(value)._fields}
    if isinstance(value, tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value
