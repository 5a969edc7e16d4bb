"""Run partitions in onnxruntime, chained by name, and compare splits with the whole model."""
from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import onnxruntime as ort
import pytest

from models.probe import session_options


def run_bytes(data: bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(data, session_options(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def run_chain(parts: Iterable[object], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    env = dict(feeds)
    for p in parts:
        env.update(run_bytes(p.onnx_bytes, env))  # type: ignore[attr-defined]
    return env


def split_and_compare(p: object, feeds: dict[str, np.ndarray], ref: dict[str, object],
                      tol: float = 1e-5) -> list[int]:
    """Split 2, 3 and 4 ways (or check the one-line refusal), chain each split in
    onnxruntime and compare with ``ref``; the partition counts that split."""
    from models.cuts import max_partitions
    from models.errors import ModelError
    from models.probe import rel_diff

    done = []
    for k in (2, 3, 4):
        if k > max_partitions(p.ga):  # type: ignore[attr-defined]
            with pytest.raises(ModelError, match=f"cannot split into {k} partitions") as info:
                p.split_into(k)  # type: ignore[attr-defined]
            assert "\n" not in str(info.value)
            continue
        parts = p.split_into(k)  # type: ignore[attr-defined]
        assert len(parts) == k
        for a, b in itertools.pairwise(parts):
            assert a.output_names == b.input_names
        env = run_chain(parts, feeds)
        worst = max(rel_diff(env[name], want) for name, want in ref.items())
        assert worst <= tol, (k, worst)
        done.append(k)
    return done
