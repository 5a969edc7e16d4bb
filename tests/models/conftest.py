"""Shared helpers for the models tests: run partitions in onnxruntime, chained by name."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")


def run_bytes(data: bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def run_chain(parts: Iterable[object], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    env = dict(feeds)
    for p in parts:
        env.update(run_bytes(p.onnx_bytes, env))  # type: ignore[attr-defined]
    return env


@pytest.fixture(scope="session")
def zoo_models() -> dict[str, object]:
    from models import zoo

    return {name: zoo.build(name) for name in zoo.NAMES}


@pytest.fixture
def chain_runner() -> Callable[..., dict[str, np.ndarray]]:
    return run_chain


@pytest.fixture
def bytes_runner() -> Callable[..., dict[str, np.ndarray]]:
    return run_bytes


def random_input(ga: object, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=ga.tensors[n].shape).astype(np.float32)  # type: ignore[attr-defined]
            for n in ga.inputs}  # type: ignore[attr-defined]


@pytest.fixture
def make_input() -> Callable[..., dict[str, np.ndarray]]:
    return random_input
