"""The canary's held-out batch and the coordinator's own run of the released ONNX (onnxruntime).

The batch is ``RolloutPolicy.holdout`` (an ``.npz`` with one array per model
input, the first axis indexing requests: request ``i`` sends ``x[i:i+1]``),
else ``probe_requests`` seeded random requests of the model's declared input
shapes (symbolic dimensions as 1). Either way the fog's answers are compared
with this process's run of the very bytes that were released, so a fog that
serves other bytes, drops partitions or computes wrong values fails the
check whatever the data.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .release import ReleaseError

__all__ = ["held_out_batch", "reference_outputs"]

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def _session(blob: bytes) -> Any:
    import onnxruntime as ort

    try:
        return ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own classes
        raise ReleaseError(f"onnxruntime cannot load the release here: {str(exc).splitlines()[0][:200]}") from None


def held_out_batch(blob: bytes, n: int, holdout: str = "", seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Up to ``n`` requests (input name -> array with a leading 1)."""
    sess = _session(blob)
    inputs = sess.get_inputs()
    if holdout:
        try:
            with np.load(Path(holdout).expanduser(), allow_pickle=False) as npz:
                arrays = {k: np.asarray(npz[k]) for k in npz.files}
        except (OSError, ValueError) as exc:
            raise ReleaseError(f"cannot read the held-out batch {holdout}: {exc}") from None
        missing = [i.name for i in inputs if i.name not in arrays]
        if missing:
            raise ReleaseError(f"held-out batch {holdout} has no input {missing[0]!r} (it has "
                               f"{', '.join(sorted(arrays)) or 'nothing'})")
        count = min([n] + [len(arrays[i.name]) for i in inputs])
        if count < 1:
            raise ReleaseError(f"held-out batch {holdout} is empty")
        batch: list[dict[str, np.ndarray]] = []
        for k in range(count):
            batch.append({i.name: np.ascontiguousarray(arrays[i.name][k:k + 1].astype(
                _ORT_TYPES.get(i.type, np.float32))) for i in inputs})
        return batch
    rng = np.random.default_rng(seed)
    out: list[dict[str, np.ndarray]] = []
    for _ in range(n):
        req: dict[str, np.ndarray] = {}
        for i in inputs:
            dtype = _ORT_TYPES.get(i.type)
            if dtype is None:
                raise ReleaseError(f"input {i.name!r} has type {i.type}: give a held-out batch (holdout = FILE.npz)")
            shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in i.shape)
            if np.dtype(dtype).kind == "f":
                req[i.name] = rng.standard_normal(shape).astype(dtype)
            elif np.dtype(dtype).kind == "b":
                req[i.name] = rng.random(shape) < 0.5
            else:
                req[i.name] = rng.integers(0, 2, shape).astype(dtype)
        out.append(req)
    return out


def reference_outputs(blob: bytes, batch: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """This process's onnxruntime run of the released bytes on every request."""
    sess = _session(blob)
    names = [o.name for o in sess.get_outputs()]
    out = []
    for req in batch:
        try:
            vals = sess.run(None, req)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own classes
            raise ReleaseError(f"the held-out batch does not run on the release here: "
                               f"{str(exc).splitlines()[0][:200]}") from None
        out.append(dict(zip(names, (np.asarray(v) for v in vals))))
    return out
