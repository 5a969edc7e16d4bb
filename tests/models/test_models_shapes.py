"""Input shapes as ONNX tools take them, and activation sizes from one onnxruntime run."""
from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models import graph, zoo
from models.cuts import chain_profile
from models.errors import ModelError
from models.graph import set_input_shapes
from models.partition import Partitioner, split
from models.probe import analyze, run_shapes
from models.profile import profile_model

OPSET = [helper.make_opsetid("", 17)]


def _model(nodes, inputs, outputs, inits=(), name="g") -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=OPSET, ir_version=8)


def _vi(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _anonymous() -> onnx.ModelProto:
    """Input [N, 3, ?, ?] (one named, two anonymous dims), like PP-OCR's recogniser."""
    x = _vi("x", ["N", 3, None, None])
    y = _vi("y", ["N", 3, None, None])
    return _model([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])],
                  [x], [y])


# ------------------------------------------------------------------ input shapes


def test_input_shapes_fix_anonymous_dims() -> None:
    with pytest.raises(ModelError, match=r"dynamic shape: tensor 'x'.*--input-shape x="):
        analyze(_anonymous(), dims={"N": 1})
    ga = analyze(_anonymous(), input_shapes={"x": [2, 3, 5, 7]})
    assert ga.tensors["y"].shape == (2, 3, 5, 7) and ga.tensors["h"].nbytes == 2 * 3 * 5 * 7 * 4
    # --dim and --input-shape combine; a shape may also come as a tuple.
    assert analyze(_anonymous(), dims={"N": 1}, input_shapes={"x": (1, 3, 4, 4)}).tensors[
        "y"].shape == (1, 3, 4, 4)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        ({"nope": [1, 3, 4, 4]}, "no input 'nope' .*inputs: x"),
        ({"x": [1, 3, 4]}, r"does not match the model: input 'x' has 4 dimensions"),
        ({"x": [1, 4, 4, 4]}, r"dimension 1 of input 'x' is fixed at 3"),
        ({"x": [1, 3, 0, 4]}, "must be positive"),
        ({"x": "1,3,4,4"}, "list of integers"),
    ],
)
def test_bad_input_shapes(shapes, match: str) -> None:
    with pytest.raises(ModelError, match=match) as info:
        analyze(_anonymous(), input_shapes=shapes)
    assert "\n" not in str(info.value)


def test_set_input_shapes_copies() -> None:
    m = _anonymous()
    fixed = set_input_shapes(m, {"x": [1, 3, 2, 2]})
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 2, 2]
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"


def test_partitions_keep_the_models_own_input_declarations(bytes_runner, chain_runner) -> None:
    # The first partition still takes any batch, as the exported model did.
    parts = split(analyze(_anonymous(), input_shapes={"x": [1, 3, 2, 2]}), [1])
    dims = parts[0].load().graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and dims[1].dim_value == 3
    feeds = {"x": np.ones((2, 3, 5, 5), np.float32)}
    assert np.array_equal(chain_runner(parts, feeds)["y"], -feeds["x"])


# ------------------------------------------------------------------ sizes from a run


def _data_dependent() -> onnx.ModelProto:
    """Reshape to a computed shape, Range to a computed length, NonZero: sizes only a run knows."""
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    minus1 = numpy_helper.from_array(np.array([-1], np.int64), "minus1")
    fzero = numpy_helper.from_array(np.array(0.0, np.float32), "fzero")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["shp"]),
        helper.make_node("Gather", ["shp", "one"], ["cols"]),  # scalar: 6
        helper.make_node("ReduceMax", ["r"], ["m"], keepdims=0),
        helper.make_node("Cast", ["m"], ["mi"], to=TensorProto.INT64),
        helper.make_node("Add", ["mi", "cols"], ["lim"]),  # data-dependent length
        helper.make_node("Range", ["zero", "lim", "one"], ["rng"]),
        helper.make_node("Cast", ["rng"], ["rngf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["rngf"], ["tot"], keepdims=0),
        helper.make_node("Greater", ["r", "fzero"], ["pos"]),
        helper.make_node("NonZero", ["pos"], ["nz"]),  # [2, count of positives]
        helper.make_node("Transpose", ["nz"], ["nzt"], perm=[1, 0]),
        helper.make_node("GatherND", ["r", "nzt"], ["vals"]),
        helper.make_node("Concat", ["minus1"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["vals", "flat_shape"], ["flat"]),
        helper.make_node("Mul", ["flat", "tot"], ["y"]),
    ]
    return _model(nodes, [_vi("x", [4, 6])], [_vi("y", [None])],
                  inits=[zero, one, minus1, fzero], name="datadep")


def test_data_dependent_sizes_come_from_a_run() -> None:
    with pytest.raises(ModelError, match="static shape inference cannot size"):
        analyze(_data_dependent(), shapes="static")
    ga = analyze(_data_dependent())
    assert ga.shape_source == "run"
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)  # the probe's data
    r = np.maximum(x, 0)
    count = int((r > 0).sum())
    assert ga.tensors["nz"].shape == (2, count) and ga.tensors["nz"].dtype == "int64"
    assert ga.tensors["rng"].shape == (int(r.max()) + 6,)
    assert ga.tensors["y"].shape == (count,) and ga.tensors["y"].nbytes == 4 * count


def test_data_dependent_partitions_run_on_other_data(bytes_runner, chain_runner) -> None:
    """Cut tensors whose size depends on the data are declared open, not at the run's size."""
    model = _data_dependent()
    p = Partitioner(analyze(model))
    n = len(p.ga.nodes)
    for seed in (1, 2, 3):
        feeds = {"x": np.random.default_rng(seed).standard_normal((4, 6)).astype(np.float32)}
        ref = bytes_runner(model.SerializeToString(), feeds)["y"]
        for cuts in ([c] for c in range(1, n)):
            got = chain_runner(p.split(cuts), feeds)["y"]
            assert got.shape == ref.shape and np.allclose(got, ref, rtol=1e-6), cuts


@pytest.mark.parametrize("name", zoo.NAMES)
def test_a_run_agrees_with_exact_static_inference(name: str) -> None:
    model = zoo.build(name)
    static, ran = analyze(model, shapes="static"), analyze(model, shapes="run")
    assert ran.shape_source == "run" and static.shape_source == "static"
    assert {t: ran.tensors[t] for t in ran.birth} == {t: static.tensors[t] for t in static.birth}


def test_dropout_mask_nobody_reads_is_sized(bytes_runner) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("Dropout", ["h"], ["d", "mask"]),
             helper.make_node("Neg", ["d"], ["y"])]
    for opset, dtype, nbytes in ((9, "float32", 24 * 4), (17, "bool", 24)):
        m = helper.make_model(helper.make_graph(nodes, "drop", [_vi("x", [4, 6])],
                                                [_vi("y", [4, 6])]),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
        ga = analyze(m)
        assert ga.shape_source == "static"  # by the operator's definition, no run needed
        assert (ga.tensors["mask"].shape, ga.tensors["mask"].dtype) == ((4, 6), dtype)
        assert ga.tensors["mask"].nbytes == nbytes
        ran = analyze(m, shapes="run")
        assert ran.tensors["mask"] == ga.tensors["mask"]


def test_input_values_pick_the_branch_the_run_takes() -> None:
    """An integer input that selects a mode (Silero's sample rate) is given, not guessed."""
    cond_then = helper.make_graph([helper.make_node("Identity", ["x"], ["o1"])], "then", [],
                                  [_vi("o1", [2])])
    cond_else = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["o2"], axis=0)],
                                  "else", [], [_vi("o2", [4])])
    eight = numpy_helper.from_array(np.array(8, np.int64), "eight")
    nodes = [helper.make_node("Equal", ["sr", "eight"], ["is8"]),
             helper.make_node("If", ["is8"], ["y"], then_branch=cond_then, else_branch=cond_else)]
    m = _model(nodes, [_vi("x", [2]), _vi("sr", [], TensorProto.INT64)], [_vi("y", [None])],
               inits=[eight])
    assert analyze(m).tensors["y"].shape == (4,)  # sr ran as 0: the else branch
    assert analyze(m, input_values={"sr": 8}).tensors["y"].shape == (2,)
    with pytest.raises(ModelError, match="no input 'rate'"):
        analyze(m, input_values={"rate": 8})
    with pytest.raises(ModelError, match="has 2 element"):
        analyze(m, input_values={"sr": [8, 8]})


def test_a_model_that_does_not_run_with_the_given_shape() -> None:
    # Reshape to [5, -1] cannot take 4*6 elements.
    five = numpy_helper.from_array(np.array([5], np.int64), "five")
    minus1 = numpy_helper.from_array(np.array([-1], np.int64), "minus1")
    nodes = [helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("Concat", ["five", "minus1"], ["shape_raw"], axis=0),
             helper.make_node("Reshape", ["h", "shape_raw"], ["y"])]
    m = _model(nodes, [_vi("x", ["N", None])], [_vi("y", [None, None])], inits=[five, minus1])
    with pytest.raises(ModelError) as info:
        analyze(m, input_shapes={"x": [4, 6]})
    msg = str(info.value)
    assert "\n" not in msg and "x=4,6" in msg, msg
    assert analyze(m, input_shapes={"x": [5, 5]}, shapes="auto").tensors["y"].shape == (5, 5)


def test_custom_op_without_kernel_names_the_tensor() -> None:
    nodes = [helper.make_node("Foo", ["x"], ["t"], domain="acme"),
             helper.make_node("Relu", ["t"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "g", [_vi("x", [2])], [_vi("y", [2])]),
                          opset_imports=[*OPSET, helper.make_opsetid("acme", 1)], ir_version=8)
    with pytest.raises(ModelError, match=r"'t' \(output of acme::Foo.*does not run"):
        analyze(m)


def test_probe_is_injectable() -> None:
    seen = {}

    def fake(model, feeds, names, *, external_dir=None):
        seen.update(feeds)
        return dict.fromkeys(names, ((4, 6), "float32", 96))

    ga = graph.analyze(zoo.build("mlp"), shapes="run", probe=fake)
    assert set(seen) == set(ga.inputs) and ga.tensors[ga.outputs[0]].shape == (4, 6)


def test_the_pure_analysis_asks_for_a_probe_instead_of_running() -> None:
    """models.graph never runs a model: sizing that needs a run without a probe is a one-line error."""
    with pytest.raises(ModelError, match=r"takes one onnxruntime run: pass probe=models\.probe\.run_shapes"):
        graph.analyze(_data_dependent())
    assert graph.analyze(_data_dependent(), probe=run_shapes).shape_source == "run"


def test_thousand_node_graph_sized_by_a_run_is_fast() -> None:
    """Budget: profile + cuts of a 1,000-node graph under 1 s (2x slack for a shared machine)."""
    data = zoo.build("deep", blocks=143).SerializeToString()
    analyze(data, shapes="run")  # onnxruntime import and first session
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        ga = analyze(data, shapes="run")
        profile_model(ga)
        chain_profile(ga, 16)
        best = min(best, time.perf_counter() - t0)
    assert len(ga.nodes) >= 1000
    assert best < 2.0, best
