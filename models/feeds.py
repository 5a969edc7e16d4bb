"""Inputs for one model run: given values where present, else seeded random data.

Pure (numpy and onnx's dtype table). Shared by the shape analysis (``models.graph``, for the
probe run it asks for) and the onnxruntime shell (``models.probe``, ``models.timing``), so
neither of those two imports the other for it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnx

__all__ = ["make_feeds", "feeds_for"]


class Analysed(Protocol):
    """What ``feeds_for`` reads of a ``models.graph.GraphAnalysis``."""

    @property
    def model(self) -> onnx.ModelProto: ...
    @property
    def tensors(self) -> Mapping[str, Any]: ...
    @property
    def inputs(self) -> Sequence[str]: ...


def make_feeds(inputs: Mapping[str, tuple[tuple[int, ...], int]],
               values: Mapping[str, np.ndarray] | None = None, *, seed: int = 0
               ) -> dict[str, np.ndarray]:
    """Inputs for one run: given ``values`` where present, else seeded random data.

    Floats are standard normal; integers and booleans are zero (a valid index,
    a valid length), which keeps Gather/Slice/Range data in range.
    """
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for name, (shape, elem_type) in inputs.items():
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        if values is not None and name in values:
            feeds[name] = np.asarray(values[name], dtype=dtype).reshape(shape)
        elif dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "O":
            feeds[name] = np.full(shape, "", dtype=object)
        else:
            feeds[name] = np.zeros(shape, dtype=dtype)
    return feeds


def feeds_for(ga: Analysed, values: Mapping[str, object] | None = None, *,
              seed: int = 0) -> dict[str, np.ndarray]:
    """``make_feeds`` for an analysed model's inputs (their fixed shapes and dtypes)."""
    vis = {vi.name: vi for vi in ga.model.graph.input}
    spec = {n: (ga.tensors[n].shape, vis[n].type.tensor_type.elem_type) for n in ga.inputs}
    return make_feeds(spec, {k: np.asarray(v) for k, v in (values or {}).items()}, seed=seed)
