"""Hypothesis strategies built from the message dataclasses themselves.

Nothing here names a message class: strategies are derived from
``MESSAGE_TYPES`` and each field's annotation, so a message type added to
``runtime.messages`` is covered by the round-trip tests without edits. A few
field *names* carry value constraints that annotations cannot express
(``sha256`` is 64 hex chars, ``public_key`` 32 bytes, enums); those are
hints, and anything a ``validate()`` still refuses is simply not generated.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from runtime._schema import Record
from runtime.errors import RemoteViolation

# Every dtype kind the codec carries, both byte orders where it matters.
DTYPES = [np.dtype(d) for d in (
    "bool", "int8", "uint8", "<i2", ">i2", "<u4", "<i8", ">i8", "<f2", "<f4", ">f4", "<f8", ">f8",
    "<c8", "<c16",
)]

ID_ALPHABET = st.characters(blacklist_characters="/+#\x00", blacklist_categories=("Cs",))
# topic levels: identifiers of runtime.ids (the one grammar)
ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True).filter(lambda s: ".." not in s)
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
ints = st.one_of(st.integers(0, 1000), st.integers(0, 2**63 - 1))
floats = st.one_of(st.floats(0.0, 1.0), st.floats(0.0, 1e12), st.sampled_from([0.0, 1.5, 1e-300]))


def arrays() -> st.SearchStrategy[np.ndarray]:
    """Arrays of any carried dtype, 0-d and empty included."""
    return st.sampled_from(DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))


# Field-name hints for constraints that live in validate(), not in the type.
NAME_HINTS: dict[str, st.SearchStrategy[Any]] = {
    "sha256": st.text("0123456789abcdef", min_size=64, max_size=64),
    "public_key": st.binary(min_size=32, max_size=32),
    "health": st.sampled_from(["running", "loading", "failed"]),
    "effect": st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
    "battery_level": st.none() | st.floats(0.0, 1.0),
    "hop": st.integers(0, 2),
    "keys": st.lists(st.binary(min_size=32, max_size=32), max_size=3).map(tuple),
    # device rates start at 1 (runtime.devices.RESOURCE_RANGES): most generic floats lie below
    "flops": st.floats(1.0, 1e12),
    "uplink_bps": st.floats(1.0, 1e12),
    "downlink_bps": st.floats(1.0, 1e12),
}
# Tuple fields that validate() wants non-empty (Activation.route must contain hop).
MIN_SIZES = {"route": 1}


def for_type(tp: Any, name: str = "") -> st.SearchStrategy[Any]:
    """Strategy for one annotated type (recursing into tuples, dicts, optionals, records)."""
    origin = typing.get_origin(tp)
    if tp is str:
        return ids
    if tp is int:
        return ints
    if tp is float:
        return floats
    if tp is bool:
        return st.booleans()
    if tp is bytes:
        return st.binary(max_size=48)
    if tp is np.ndarray:
        return arrays()
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.none() | for_type(inner, name)
    if origin is tuple:
        item = typing.get_args(tp)[0]
        return st.lists(for_type(item), min_size=MIN_SIZES.get(name, 0), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(texts, for_type(typing.get_args(tp)[1]), max_size=3)
    if isinstance(tp, type) and issubclass(tp, Record):
        return records(tp)
    raise TypeError(f"no strategy for {tp!r}: extend tests/runtime/runtime_strategies.py")


@st.composite
def _build(draw: st.DrawFn, cls: type) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if optional and draw(st.integers(0, 4)) == 0:
            continue  # leave the default in place now and then
        hint = NAME_HINTS.get(f.name)
        kwargs[f.name] = draw(hint if hint is not None else for_type(hints[f.name], f.name))
    try:
        return cls(**kwargs)
    except RemoteViolation:
        assume(False)  # a validate() rule no hint covers: not a valid message, draw again


_cache: dict[type, st.SearchStrategy[Any]] = {}


def records(cls: type) -> st.SearchStrategy[Any]:
    """Valid instances of a message or record class."""
    if cls not in _cache:
        _cache[cls] = _build(cls)
    return _cache[cls]


# --------------------------------------------------------------- comparison


def assert_same(a: Any, b: Any, path: str = "msg") -> None:
    """Deep equality that understands arrays (dataclass ``==`` cannot compare them)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, Record):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def iter_arrays(value: Any) -> typing.Iterator[np.ndarray]:
    if isinstance(value, Record):
        for f in dataclasses.fields(value):
            yield from iter_arrays(getattr(value, f.name))
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_arrays(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_arrays(v)
    elif isinstance(value, np.ndarray):
        yield value


def bounded(max_examples: int = 60) -> Any:
    """Settings for these tests: bounded, no deadline (2 shared cores), without touching global profiles."""
    from hypothesis import HealthCheck, settings

    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])
