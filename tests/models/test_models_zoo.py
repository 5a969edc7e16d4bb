"""The zoo builds checked, runnable, seeded models with the structure each one promises."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from models import zoo
from models.errors import ModelError
from models.graph import analyze


@pytest.mark.parametrize("name", zoo.NAMES)
def test_builds_checked_runnable_model(name: str, bytes_runner, make_input) -> None:
    model = zoo.build(name)
    onnx.checker.check_model(model, full_check=True)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    ga = analyze(model)
    feeds = make_input(ga)
    out = bytes_runner(model.SerializeToString(), feeds)[ga.outputs[0]]
    assert out.shape == ga.tensors[ga.outputs[0]].shape
    assert np.isfinite(out).all()


@pytest.mark.parametrize("name", zoo.NAMES)
def test_seeded_and_deterministic(name: str) -> None:
    a, b = zoo.build(name), zoo.build(name)
    assert a.SerializeToString() == b.SerializeToString()
    if name != "mlp":  # the mlp seed only moves weights, checked below
        assert zoo.build(name, seed=1).SerializeToString() != a.SerializeToString()


@pytest.mark.parametrize(
    ("name", "ops"),
    [
        ("mlp", {"Gemm", "Relu"}),
        ("resnet", {"Conv", "BatchNormalization", "Add", "GlobalAveragePool", "Gemm"}),
        ("inception", {"Conv", "MaxPool", "Concat"}),
        ("transformer", {"MatMul", "Softmax", "LayerNormalization", "Add", "Erf"}),
        ("deep", {"MatMul", "Add", "Relu"}),
    ],
)
def test_structure(name: str, ops: set[str]) -> None:
    model = zoo.build(name)
    assert ops <= {n.op_type for n in model.graph.node}


def test_inception_joins_four_branches() -> None:
    concat = [n for n in zoo.build("inception").graph.node if n.op_type == "Concat"]
    assert concat and all(len(n.input) == 4 for n in concat)


def test_deep_has_about_500_nodes_and_scales() -> None:
    assert len(zoo.build("deep").graph.node) == 505
    assert len(zoo.build("deep", blocks=3).graph.node) == 22


def test_mlp_seed_changes_weights() -> None:
    a = onnx.numpy_helper.to_array(zoo.build("mlp").graph.initializer[0])
    b = onnx.numpy_helper.to_array(zoo.build("mlp", seed=3).graph.initializer[0])
    assert a.shape == (64, 32) and not np.array_equal(a, b)


@pytest.mark.parametrize(("name", "kw"), [("nope", {}), ("mlp", {"bogus": 1}),
                                          ("transformer", {"d_model": 30, "heads": 4})])
def test_bad_requests_raise_model_error(name: str, kw: dict) -> None:
    with pytest.raises(ModelError):
        zoo.build(name, **kw)
