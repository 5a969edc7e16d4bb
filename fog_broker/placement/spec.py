"""The one error of malformed placement documents and the field readers that raise it.

Shared by the model (``model.py``) and the plans (``plan.py``): every wrong type or range in a
FLEET, WORKLOADS or plan document becomes one ``SpecError`` naming the field. The readers are
package-private (underscored); callers outside ``fog_broker.placement`` use ``from_dict``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from runtime.errors import RemoteViolation

__all__ = ["SpecError"]


class SpecError(RemoteViolation):
    """A fleet, workload or plan document that does not match the documented format."""


# --- field readers: one place that turns wrong types into SpecError -------------------------


def _obj(d: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise SpecError(f"{where}: expected an object, got {type(d).__name__}")
    return d


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise SpecError(f"{where}: missing field '{key}'")
    return d[key]


def _num(v: Any, where: str, *, minimum: float | None = 0.0, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SpecError(f"{where}: expected a finite number, got {v!r}")
    if positive and v <= 0:
        raise SpecError(f"{where}: must be > 0, got {v!r}")
    if minimum is not None and v < minimum:
        raise SpecError(f"{where}: must be >= {minimum:g}, got {v!r}")
    return float(v)


def _int(v: Any, where: str, *, minimum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise SpecError(f"{where}: expected an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise SpecError(f"{where}: must be >= {minimum}, got {v!r}")
    return int(v)


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise SpecError(f"{where}: expected a boolean, got {v!r}")
    return v


def _str(v: Any, where: str, *, empty_ok: bool = False) -> str:
    if not isinstance(v, str) or (not v and not empty_ok):
        raise SpecError(f"{where}: expected a non-empty string, got {v!r}")
    return v


def _strmap(v: Any, where: str) -> tuple[tuple[str, str], ...]:
    m = _obj(v, where)
    out = []
    for k, val in m.items():
        if not isinstance(k, str) or not isinstance(val, str):
            raise SpecError(f"{where}: labels must map strings to strings, got {k!r}: {val!r}")
        out.append((k, val))
    return tuple(sorted(out))


def _list(v: Any, where: str) -> Sequence[Any]:
    if not isinstance(v, list):
        raise SpecError(f"{where}: expected a list, got {type(v).__name__}")
    return v


def _strs(v: Any, where: str) -> tuple[str, ...]:
    return tuple(_str(x, f"{where}[{i}]") for i, x in enumerate(_list(v, where)))


def _segment_times(v: Any, n: int | None, where: str) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """``{device id, class or class:NAME: [seconds per segment]}``, every list as long as the chain."""
    out = []
    for key, times in _obj(v, where).items():
        w = f"{where}.{key}"
        if not isinstance(key, str) or not key:
            raise SpecError(f"{where}: keys must be device ids or classes, got {key!r}")
        secs = tuple(_num(t, f"{w}[{i}]") for i, t in enumerate(_list(times, w)))
        if n is not None and len(secs) != n:
            raise SpecError(f"{w}: {len(secs)} segment times for a chain of {n} segments")
        out.append((key, secs))
    return tuple(sorted(out))


def _strict(d: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """Unknown fields are errors, not ignored (kubectl's strict field validation): the first one is
    named, with the closest known field when one is close (a typo)."""
    import difflib

    for key in d:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
            hint = f"; did you mean '{close[0]}'?" if close else f" (known: {', '.join(sorted(known))})"
            raise SpecError(f"{where}: unknown field '{str(key)[:60]}'{hint}")


def _input_shapes(v: Any, where: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for name, dims in _obj(v, where).items():
        w = f"{where}.{name}"
        out.append((str(name), tuple(_int(x, f"{w}[{i}]", minimum=1)
                                     for i, x in enumerate(_list(dims, w)))))
    return tuple(out)
