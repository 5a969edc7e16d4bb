"""Bad input gets a ModelError naming the problem, never a traceback from deep inside onnx."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from models import zoo
from models.cuts import chain_profile, enumerate_cuts
from models.errors import ModelError
from models.graph import analyze, pin_dims
from models.graph_files import load_model, open_model
from models.partition import split
from models.profile import profile_model
from runtime.errors import FoglineError


def _dynamic() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["h"]),
                           helper.make_node("Neg", ["h"], ["y"])], "dyn", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_error_class_hierarchy() -> None:
    assert issubclass(ModelError, FoglineError) and issubclass(ModelError, ValueError)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (lambda good: good[: len(good) // 2], "truncated or corrupt|invalid ONNX"),
        (lambda good: b"\xff\xfe not onnx at all \x00" * 5, "truncated or corrupt|invalid ONNX"),
        (lambda good: b"", "empty file"),
    ],
    ids=["truncated", "garbage", "empty"],
)
@pytest.mark.parametrize("fn", [analyze, profile_model, enumerate_cuts, chain_profile])
def test_bad_files(tmp_path, payload, match: str, fn) -> None:
    good = zoo.build("resnet").SerializeToString()
    path = tmp_path / "bad.onnx"
    path.write_bytes(payload(good))
    with pytest.raises(ModelError, match=match) as info:
        fn(open_model(path))
    assert str(path) in str(info.value)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ModelError, match="no such file"):
        open_model(tmp_path / "nope.onnx")


def test_wrong_type() -> None:
    with pytest.raises(ModelError, match="cannot load"):
        analyze(42)  # type: ignore[arg-type]


def test_invalid_graph_reads_undefined_tensor() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("Add", ["x", "ghost"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(ModelError, match=r"ghost|invalid"):
        analyze(m)


def test_empty_graph() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    m = helper.make_model(helper.make_graph([], "g", [x], [x]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(ModelError, match="no nodes"):
        analyze(m)


@pytest.mark.parametrize("fn", [analyze, profile_model, enumerate_cuts, chain_profile,
                                lambda m: split(m, [1])])
def test_dynamic_shapes_are_named(fn) -> None:
    with pytest.raises(ModelError, match=r"dynamic shape: tensor 'x'.*'N'"):
        fn(_dynamic())


def test_dynamic_shapes_can_be_pinned() -> None:
    ga = analyze(_dynamic(), dims={"N": 3})
    assert ga.tensors["y"].shape == (3, 4)
    assert len(split(pin_dims(_dynamic(), {"N": 2}), [1])) == 2
    with pytest.raises(ModelError, match="positive"):
        pin_dims(_dynamic(), {"N": 0})


def test_unknown_custom_op_without_shapes() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Foo", ["x"], ["t"], domain="acme"),
                           helper.make_node("Relu", ["t"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("acme", 1)], ir_version=8)
    with pytest.raises(ModelError, match=r"'t'.*Foo"):
        analyze(m)


def test_load_model_roundtrip(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(zoo.build("mlp").SerializeToString())
    assert len(load_model(path).graph.node) == 3
