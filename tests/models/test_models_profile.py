"""FLOP formulas on single-node models, totals on the zoo, unknown ops as warnings."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models import zoo
from models.errors import ProfileWarning
from models.graph_files import open_model
from models.profile import profile_model


def _one(op: str, x_shape: list[int], y_shape: list[int], inits: dict[str, np.ndarray],
         inputs: list[str], **attrs: object) -> onnx.ModelProto:
    node = helper.make_node(op, ["x", *inputs], ["y"], **attrs)
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


W = np.ones
CASES = [
    # name, model, flops, macs
    ("conv3x3+bias", _one("Conv", [1, 3, 8, 8], [1, 4, 8, 8], {"w": W((4, 3, 3, 3)), "b": W(4)},
                          ["w", "b"], pads=[1, 1, 1, 1]), 2 * 256 * 27 + 256, 256 * 27),
    ("conv-grouped", _one("Conv", [1, 4, 8, 8], [1, 4, 8, 8], {"w": W((4, 2, 1, 1))}, ["w"],
                          group=2), 2 * 256 * 2, 256 * 2),
    ("gemm+bias", _one("Gemm", [2, 5], [2, 3], {"w": W((5, 3)), "b": W(3)}, ["w", "b"]),
     2 * 6 * 5 + 6, 30),
    ("gemm-transB", _one("Gemm", [2, 5], [2, 3], {"w": W((3, 5))}, ["w"], transB=1), 60, 30),
    ("matmul-batched", _one("MatMul", [2, 4, 5], [2, 4, 3], {"w": W((5, 3))}, ["w"]),
     2 * 24 * 5, 120),
    ("relu", _one("Relu", [2, 8], [2, 8], {}, []), 16, 0),
    ("add", _one("Add", [2, 8], [2, 8], {"c": W(8)}, ["c"]), 16, 0),
    ("exp", _one("Exp", [2, 8], [2, 8], {}, []), 64, 0),
    ("maxpool", _one("MaxPool", [1, 2, 8, 8], [1, 2, 4, 4], {}, [], kernel_shape=[2, 2],
                     strides=[2, 2]), 32 * 4, 0),
    ("gap", _one("GlobalAveragePool", [1, 2, 8, 8], [1, 2, 1, 1], {}, []), 128, 0),
    ("batchnorm", _one("BatchNormalization", [1, 2, 4, 4], [1, 2, 4, 4],
                       {"s": W(2), "b": W(2), "m": W(2), "v": W(2)}, ["s", "b", "m", "v"]),
     64, 0),
    ("layernorm", _one("LayerNormalization", [2, 8], [2, 8], {"g": W(8), "b": W(8)},
                       ["g", "b"]), 80, 0),
    ("softmax", _one("Softmax", [2, 8], [2, 8], {}, []), 80, 0),
    ("flatten-free", _one("Flatten", [2, 8], [2, 8], {}, []), 0, 0),
]


@pytest.mark.parametrize(("name", "model", "flops", "macs"), CASES, ids=[c[0] for c in CASES])
def test_flop_formulas(name: str, model: onnx.ModelProto, flops: int, macs: int) -> None:
    prof = profile_model(model)
    assert (prof.flops, prof.macs) == (flops, macs)
    assert prof.unknown_ops == ()


def test_param_and_activation_bytes() -> None:
    model = _one("Gemm", [2, 5], [2, 3], {"w": W((5, 3)), "b": W(3)}, ["w", "b"])
    prof = profile_model(model)
    node = prof.nodes[0]
    assert node.param_bytes == (15 + 3) * 4 == prof.param_bytes
    assert node.input_bytes == 40 and node.output_bytes == 24
    assert node.live_bytes == 64 == prof.peak_activation_bytes
    assert (prof.input_bytes, prof.output_bytes) == (40, 24)


def test_mlp_totals() -> None:
    prof = profile_model(zoo.build("mlp"))
    assert prof.macs == 64 * 32 + 32 * 10
    assert prof.param_bytes == 4 * (64 * 32 + 32 + 32 * 10 + 10)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_zoo_totals_are_consistent(name: str) -> None:
    model = zoo.build(name)
    prof = profile_model(model)
    inits = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    assert prof.param_bytes == inits
    assert prof.flops == sum(n.flops for n in prof.nodes) > 0
    assert prof.unknown_ops == ()
    assert len(prof.nodes) == len(model.graph.node)
    assert prof.to_dict()["nodes"][0]["op_type"] == prof.nodes[0].op_type


def test_resnet_skip_is_counted_in_live_bytes() -> None:
    prof = profile_model(zoo.build("resnet"))
    # Inside a block the skip tensor stays alive, so live > in + out of some node.
    assert any(n.live_bytes > n.input_bytes + n.output_bytes for n in prof.nodes)


def test_unknown_op_is_zero_flops_with_warning() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph(
        [helper.make_node("Einsum", ["x", "x"], ["t"], equation="ij,ij->ij"),
         helper.make_node("Foo", ["t"], ["u"], domain="com.acme"),
         helper.make_node("Relu", ["u"], ["y"])],
        "g", [x], [y], value_info=[helper.make_tensor_value_info("u", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.acme", 1)], ir_version=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile_model(m)
    messages = [str(w.message) for w in caught if issubclass(w.category, ProfileWarning)]
    assert any("Einsum" in s for s in messages) and any("com.acme::Foo" in s for s in messages)
    assert prof.unknown_ops == ("Einsum", "com.acme::Foo")
    assert prof.flops == 6  # only the Relu


def test_accepts_path_and_bytes(tmp_path) -> None:
    model = zoo.build("mlp")
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    a, b, c = profile_model(model), profile_model(open_model(path)), profile_model(path.read_bytes())
    assert a.flops == b.flops == c.flops


@pytest.mark.parametrize(("op", "gates"), [("LSTM", 4), ("GRU", 3), ("RNN", 1)])
def test_recurrent_flops(op: str, gates: int) -> None:
    seq, batch, feat, hidden = 5, 2, 8, 16
    w = numpy_helper.from_array(np.zeros((1, gates * hidden, feat), np.float32), "W")
    r = numpy_helper.from_array(np.zeros((1, gates * hidden, hidden), np.float32), "R")
    node = helper.make_node(op, ["x", "W", "R"], ["y"], hidden_size=hidden)
    g = helper.make_graph([node], "rnn", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [seq, batch, feat])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [seq, 1, batch, hidden])], initializer=[w, r])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    prof = profile_model(m)
    macs = seq * batch * gates * hidden * (feat + hidden)
    assert prof.macs == macs and prof.flops > 2 * macs and not prof.unknown_ops
