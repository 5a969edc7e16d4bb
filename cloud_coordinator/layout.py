"""What a model's arrays look like, and whether a client's reply matches it (pure).

A Flower ``ArrayRecord`` is an ordered mapping of names to arrays (a PyTorch
``state_dict``, a list of numpy layers); ``Layout`` keeps names, dtypes and
shapes in that order. Robust rules see one flat vector per client (the layers
concatenated); ``Layout`` maps it back without changing the user's layout.
Arrays are duck-typed (``dtype``, ``shape``, ``stype``, ``data``: Flower's
``Array``), so this module does not import Flower. Every way a reply can be
wrong maps to one fixed reason phrase, counted per round.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from runtime.errors import LocalViolation

from .aggregation._rows import ALLOWED_KINDS, BadBuffer, RowStack, npy_view

__all__ = ["Layout", "ArrayLike", "check_arrays", "check_count", "NPY_STYPE", "REASONS",
           "CLIENT_ERROR", "NO_ARRAYS", "WRONG_KEYS", "BAD_ARRAY", "BAD_COUNT", "MALFORMED",
           "DUPLICATE_REPLY", "UNEXPECTED_REPLY", "DUPLICATE_DEVICE", "UNKNOWN_NODE", "MAX_EXAMPLES",
           "stack_rows", "reason_key"]

NPY_STYPE = "numpy.ndarray"
MAX_EXAMPLES = 10**9  # more examples than any device holds: a count beyond it is a lie

CLIENT_ERROR = "client error"
NO_ARRAYS = "no arrays"
WRONG_KEYS = "wrong array names"
BAD_ARRAY = "bad array"  # + ": " + the BadBuffer reason
BAD_COUNT = "absurd example count"
MALFORMED = "malformed reply"
DUPLICATE_REPLY = "duplicate reply"
UNEXPECTED_REPLY = "unexpected reply"
DUPLICATE_DEVICE = "duplicate device"
UNKNOWN_NODE = "unknown node"
REASONS = (CLIENT_ERROR, NO_ARRAYS, WRONG_KEYS, BAD_ARRAY, BAD_COUNT, MALFORMED, DUPLICATE_REPLY,
           UNEXPECTED_REPLY, DUPLICATE_DEVICE, UNKNOWN_NODE)


def reason_key(why: str) -> str:
    """The metric name of a rejection: a Flower error's code and reason stay in the report, not in metric names."""
    return CLIENT_ERROR if why.startswith(CLIENT_ERROR) else why


class ArrayLike(Protocol):
    """Flower's ``Array`` as read here (read-only members, so a ``tuple`` shape fits)."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def stype(self) -> str: ...
    @property
    def data(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Layout:
    """Names, dtypes and shapes of a model's arrays, in order."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.names:
            raise LocalViolation("a model needs at least one array")
        if len(set(self.names)) != len(self.names):
            raise LocalViolation("array names must be unique")
        for dt in self.dtypes:
            if np.dtype(dt).kind not in ALLOWED_KINDS:
                raise LocalViolation(f"arrays of dtype {dt} cannot be aggregated")

    @classmethod
    def of(cls, arrays: Mapping[str, ArrayLike]) -> Layout:
        """The layout of an ``ArrayRecord`` (or any mapping of Array-likes)."""
        for name, a in arrays.items():
            if a.stype != NPY_STYPE:
                raise LocalViolation(f"array {name!r} is serialised as {a.stype!r}, not {NPY_STYPE}")
        return cls(tuple(arrays), tuple(str(np.dtype(a.dtype)) for a in arrays.values()),
                   tuple(tuple(int(s) for s in a.shape) for a in arrays.values()))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def digest(self) -> str:
        """A short stable hash (names, dtypes, shapes), part of a run's identity."""
        text = repr((self.names, self.dtypes, self.shapes)).encode()
        return hashlib.sha256(text).hexdigest()[:16]

    def flat(self, arrays: Mapping[str, ArrayLike]) -> np.ndarray:
        """The arrays as one float64 vector (the global model; raises ``LocalViolation``)."""
        views = check_arrays(self, arrays)
        if isinstance(views, str):
            raise LocalViolation(f"arrays do not match the model layout ({views})")
        return np.concatenate([v.astype(np.float64) for v in views]) if views else np.zeros(0)

    def split(self, vec: np.ndarray) -> list[np.ndarray]:
        """One flat vector back into arrays of this layout (each in its own dtype)."""
        if vec.shape != (self.size,):
            raise LocalViolation(f"a vector of {vec.size} does not fit a model of {self.size}")
        out, i = [], 0
        for dt, shape, n in zip(self.dtypes, self.shapes, self.sizes):
            part = vec[i:i + n].reshape(shape)
            dtype = np.dtype(dt)
            if dtype.kind in "biu":  # integer buffers (e.g. BatchNorm's num_batches_tracked)
                info = np.iinfo(dtype) if dtype.kind != "b" else None
                part = np.rint(part)
                if info is not None:
                    part = np.clip(part, info.min, info.max)
            out.append(np.asarray(part).astype(dtype, order="C"))
            i += n
        return out


def check_arrays(layout: Layout, arrays: Mapping[str, ArrayLike]) -> list[np.ndarray] | str:
    """Zero-copy 1-D views of a reply's arrays in layout order, or the reason they are unusable."""
    if list(arrays) != list(layout.names):  # order too: rows must line up coordinate by coordinate
        return WRONG_KEYS
    views: list[np.ndarray] = []
    for name, dt, shape in zip(layout.names, layout.dtypes, layout.shapes):
        a = arrays[name]
        if getattr(a, "stype", None) != NPY_STYPE or str(getattr(a, "dtype", "")) != dt or \
                tuple(int(s) for s in getattr(a, "shape", ())) != shape:
            return f"{BAD_ARRAY}: declared layout mismatch"
        data = getattr(a, "data", None)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return f"{BAD_ARRAY}: no data"
        try:
            views.append(npy_view(data, np.dtype(dt), shape))
        except BadBuffer as exc:
            return f"{BAD_ARRAY}: {exc.reason}"
    return views


def check_count(value: Any, max_examples: int = MAX_EXAMPLES) -> float | str:
    """A reported example count as a float, or ``BAD_COUNT`` (NaN, Inf, negative, absurd, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return BAD_COUNT
    try:
        v = float(value)
    except (OverflowError, ValueError):
        return BAD_COUNT
    if not math.isfinite(v) or v < 0 or v > max_examples:
        return BAD_COUNT
    return v


def stack_rows(rows: Iterable[Sequence[np.ndarray]]) -> RowStack:
    """The accepted replies' views as one virtual (n, d) matrix (no copy)."""
    return RowStack([list(r) for r in rows])
