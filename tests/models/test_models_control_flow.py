"""If, Loop and Scan: a node with subgraphs stays whole, and every outer tensor it reads
(directly or from a nested subgraph) crosses the cuts before it; several inputs/outputs chain."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.cuts import enumerate_cuts, max_partitions
from models.partition import Partitioner
from models.probe import analyze

OPSET = [helper.make_opsetid("", 17)]
TOL = 1e-5


def _vi(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _init(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "cf", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=OPSET, ir_version=8)


def if_model() -> onnx.ModelProto:
    """The branches read 'a' (made two nodes earlier) and the outer weight 'w'."""
    then_g = helper.make_graph([helper.make_node("Add", ["a", "w"], ["t1"])], "then", [],
                               [_vi("t1", [2, 3])])
    else_g = helper.make_graph([helper.make_node("Mul", ["a", "a"], ["t2"])], "else", [],
                               [_vi("t2", [2, 3])])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Neg", ["x"], ["b"]),
        helper.make_node("ReduceSum", ["b"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Sigmoid", ["y"], ["z"]),
    ]
    return _model(nodes, [_vi("x", [2, 3])], [_vi("z", [2, 3])],
                  [_init("zero", np.float32(0)), _init("w", np.full((2, 3), 0.5, np.float32))])


def loop_model() -> onnx.ModelProto:
    """A Loop whose body holds an If that reads 'a' from two scopes out (nested capture)."""
    inner_then = helper.make_graph([helper.make_node("Add", ["v_in", "a"], ["u1"])], "it", [],
                                   [_vi("u1", [2, 3])])
    inner_else = helper.make_graph([helper.make_node("Sub", ["v_in", "a"], ["u2"])], "ie", [],
                                   [_vi("u2", [2, 3])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
         helper.make_node("Greater", ["i_f", "half"], ["odd_ish"]),
         helper.make_node("If", ["odd_ish"], ["v_out"], then_branch=inner_then,
                          else_branch=inner_else)],
        "body",
        [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
         _vi("v_in", [2, 3])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("v_out", [2, 3])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Tanh", ["x"], ["v0"]),
        helper.make_node("Exp", ["h"], ["e"]),  # second input, read late
        helper.make_node("Loop", ["trips", "true", "v0"], ["v"], body=body),
        helper.make_node("Add", ["v", "e"], ["y"]),
        helper.make_node("Neg", ["e"], ["h_next"]),  # a state output, as an RNN has
    ]
    return _model(nodes, [_vi("x", [2, 3]), _vi("h", [2, 3])],
                  [_vi("y", [2, 3]), _vi("h_next", [2, 3])],
                  [_init("trips", np.int64(3)), _init("true", np.bool_(True)),
                   _init("half", np.float32(0.5))])


def scan_model() -> onnx.ModelProto:
    """A running sum over rows, scaled by an outer tensor the body captures."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["row", "scale"], ["scaled"]),
         helper.make_node("Add", ["acc_in", "scaled"], ["acc_out"]),
         helper.make_node("Identity", ["acc_out"], ["row_out"])],
        "scan_body", [_vi("acc_in", [3]), _vi("row", [3])],
        [_vi("acc_out", [3]), _vi("row_out", [3])],
    )
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["scale_full"]),
        helper.make_node("ReduceMean", ["scale_full"], ["scale"], axes=[0], keepdims=0),
        helper.make_node("Relu", ["x"], ["rows"]),
        helper.make_node("Scan", ["acc0", "rows"], ["acc", "partial"], body=body,
                         num_scan_inputs=1),
        helper.make_node("Neg", ["partial"], ["y"]),
    ]
    return helper.make_model(
        helper.make_graph(nodes, "scan", [_vi("x", [4, 3]), _vi("acc0", [3])],
                          [_vi("acc", [3]), _vi("y", [4, 3])]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


MODELS = {"if": if_model, "loop": loop_model, "scan": scan_model}


def _feeds(ga, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(ga.tensors[n].shape).astype(np.float32) for n in ga.inputs}


def test_captures_are_inputs_of_the_node() -> None:
    ga = analyze(if_model())
    i = next(k for k, n in enumerate(ga.nodes) if n.op_type == "If")
    assert {"a", "w", "c"} <= set(ga.node_inputs[i])
    ga = analyze(loop_model())
    i = next(k for k, n in enumerate(ga.nodes) if n.op_type == "Loop")
    assert "a" in ga.node_inputs[i]  # read by the If inside the Loop's body
    assert "v_in" not in ga.node_inputs[i] and "i" not in ga.node_inputs[i]  # body-local


def test_outer_tensor_crosses_every_cut_up_to_its_reader() -> None:
    ga = analyze(if_model())
    i = next(k for k, n in enumerate(ga.nodes) if n.op_type == "If")
    for cut in enumerate_cuts(ga):
        assert ("a" in cut.tensors) == (1 <= cut.index <= i), cut


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_cut_set_chains(name: str, bytes_runner, chain_runner) -> None:
    model = MODELS[name]()
    p = Partitioner(analyze(model))
    n = len(p.ga.nodes)
    cut_sets = [[c] for c in range(1, n)] + [list(range(1, n))]
    for seed in (0, 1):
        feeds = _feeds(p.ga, seed)
        ref = bytes_runner(model.SerializeToString(), feeds)
        for cuts in cut_sets:
            parts = p.split(cuts)
            for part in parts:  # every partition loads and runs on its own
                onnx.checker.check_model(part.load())
            env = chain_runner(parts, feeds)
            for out, want in ref.items():
                assert np.abs(env[out] - want).max() <= TOL * max(1.0, np.abs(want).max()), \
                    (cuts, out)


def test_if_partition_carries_the_outer_weight() -> None:
    p = Partitioner(if_model())
    i = next(k for k, n in enumerate(p.ga.nodes) if n.op_type == "If")
    parts = p.split([i, i + 1])
    middle = parts[1].load()
    assert [n.op_type for n in middle.graph.node] == ["If"]
    assert {t.name for t in middle.graph.initializer} == {"w"}
    assert set(parts[1].input_names) == {"a", "c"}


def test_split_into_refuses_more_partitions_than_cut_points() -> None:
    from models.errors import ModelError

    p = Partitioner(scan_model())
    most = max_partitions(p.ga)
    assert len(p.split_into(most)) == most
    with pytest.raises(ModelError, match=f"cannot split into {most + 1} partitions.*at most "
                                         f"{most}"):
        p.split_into(most + 1)
