"""Per-node cost profile: FLOPs, MACs, parameter bytes and activation bytes from shapes.

Conventions (what the scheduler's compute time ``flops / device.flops`` assumes):
a multiply-accumulate is 2 FLOPs; Conv/Gemm add one FLOP per output for the bias;
elementwise ops cost one FLOP per output element, transcendental ones (Exp, Erf,
Sigmoid, ...) four; normalisations and Softmax a few per element; data movement
(Reshape, Transpose, Concat, ...) is free. An op without a formula counts as
zero FLOPs and raises a ``ProfileWarning`` naming it.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

from models.errors import ProfileWarning
from models.graph import GraphAnalysis, ModelSource, TensorInfo, analyze

__all__ = ["ModelProfile", "NodeProfile", "profile_model", "cross_bytes", "KNOWN_OPS"]


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """Cost of one node; ``live_bytes`` is the activation memory held while it runs."""

    index: int
    name: str
    op_type: str
    flops: int
    macs: int
    param_bytes: int  # weights first used by this node (each counted once per model)
    input_bytes: int  # activation inputs
    output_bytes: int
    live_bytes: int  # activations alive across this node (incl. skips) + its outputs
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "index": self.index, "name": self.name, "op_type": self.op_type,
            "flops": self.flops, "macs": self.macs, "param_bytes": self.param_bytes,
            "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
            "live_bytes": self.live_bytes,
        }


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-node profile in topological order plus model totals."""

    model: str
    nodes: tuple[NodeProfile, ...]
    flops: int
    macs: int
    param_bytes: int
    peak_activation_bytes: int
    input_bytes: int
    output_bytes: int
    unknown_ops: tuple[str, ...]

    def to_dict(self, *, nodes: bool = True) -> dict[str, object]:
        out: dict[str, object] = {
            "model": self.model, "flops": self.flops, "macs": self.macs,
            "param_bytes": self.param_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
            "unknown_ops": list(self.unknown_ops),
        }
        if nodes:
            out["nodes"] = [n.to_dict() for n in self.nodes]
        return out


_Info = TensorInfo | None
_Rule = Callable[[onnx.NodeProto, Sequence[_Info], Sequence[_Info]], tuple[int, int]]


def _numel(t: _Info) -> int:
    return math.prod(t.shape) if t is not None else 0


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _conv(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
    w, y = ins[1], outs[0]
    if w is None or y is None:
        return 0, 0
    macs = _numel(y) * math.prod(w.shape[1:])
    bias = _numel(y) if len(ins) > 2 and ins[2] is not None else 0
    return 2 * macs + bias, macs


def _conv_transpose(node: onnx.NodeProto, ins: Sequence[_Info],
                    outs: Sequence[_Info]) -> tuple[int, int]:
    x, w = ins[0], ins[1]
    if x is None or w is None:
        return 0, 0
    macs = _numel(x) * math.prod(w.shape[1:])
    bias = _numel(outs[0]) if len(ins) > 2 and ins[2] is not None else 0
    return 2 * macs + bias, macs


def _gemm(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
    a, y = ins[0], outs[0]
    if a is None or y is None:
        return 0, 0
    k = a.shape[0] if _attr(node, "transA", 0) else a.shape[-1]
    macs = _numel(y) * k
    bias = _numel(y) if len(ins) > 2 and ins[2] is not None else 0
    return 2 * macs + bias, macs


def _matmul(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
    a, y = ins[0], outs[0]
    if a is None or y is None or not a.shape:
        return 0, 0
    macs = _numel(y) * a.shape[-1]
    return 2 * macs, macs


def _per_output(cost: int) -> _Rule:
    def rule(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
        return cost * _numel(outs[0] if outs else None), 0
    return rule


def _per_input(cost: int) -> _Rule:
    def rule(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
        return cost * _numel(ins[0] if ins else None), 0
    return rule


def _variadic(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
    return max(len(ins) - 1, 1) * _numel(outs[0]), 0


def _pool(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
    kernel = _attr(node, "kernel_shape", [1])
    assert isinstance(kernel, list)
    return _numel(outs[0]) * math.prod(int(k) for k in kernel), 0


def _recurrent(gates: int) -> _Rule:
    """RNN (1 gate), GRU (3), LSTM (4): input and recurrent MatMuls per step and direction.

    Plus per gate element: bias adds (2) and an activation (4), and 3 for the state update.
    """
    def rule(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
        x, w = ins[0], ins[1] if len(ins) > 1 else None
        r = ins[2] if len(ins) > 2 else None
        if x is None or w is None or r is None or len(x.shape) != 3:
            return 0, 0
        seq, batch = (x.shape[1], x.shape[0]) if _attr(node, "layout", 0) else x.shape[:2]
        dirs, hidden, feat = w.shape[0], r.shape[-1], w.shape[-1]
        steps = seq * batch * dirs
        macs = steps * gates * hidden * (feat + hidden)
        return 2 * macs + steps * hidden * (gates * 6 + 3), macs
    return rule


def _zero(node: onnx.NodeProto, ins: Sequence[_Info], outs: Sequence[_Info]) -> tuple[int, int]:
    return 0, 0


_RULES: dict[str, _Rule] = {
    "Conv": _conv, "ConvTranspose": _conv_transpose, "Gemm": _gemm, "MatMul": _matmul,
    "MaxPool": _pool, "AveragePool": _pool, "LpPool": _pool,
    "GlobalAveragePool": _per_input(1), "GlobalMaxPool": _per_input(1),
    "GlobalLpPool": _per_input(2),
    "BatchNormalization": _per_output(2), "LayerNormalization": _per_output(5),
    "InstanceNormalization": _per_output(5), "GroupNormalization": _per_output(5),
    "LpNormalization": _per_output(3), "MeanVarianceNormalization": _per_output(5),
    "Softmax": _per_output(5), "LogSoftmax": _per_output(5), "Hardmax": _per_output(1),
    "Sum": _variadic, "Mean": _variadic, "Max": _variadic, "Min": _variadic,
    "CumSum": _per_output(1), "ArgMax": _per_input(1), "ArgMin": _per_input(1),
    "TopK": _per_input(1), "Resize": _per_output(4), "Upsample": _per_output(4),
    "LSTM": _recurrent(4), "GRU": _recurrent(3), "RNN": _recurrent(1),
}
for _op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
            "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"):
    _RULES[_op] = _per_input(1)
for _op in ("Add", "Sub", "Mul", "Div", "Relu", "Neg", "Abs", "Clip", "LeakyRelu", "PRelu",
            "ThresholdedRelu", "HardSigmoid", "HardSwish", "Floor", "Ceil", "Round", "Sign",
            "Reciprocal", "Where", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
            "And", "Or", "Xor", "Not", "Mod", "BitShift", "Shrink", "IsNaN", "IsInf",
            "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "Celu", "Elu", "Selu"):
    _RULES[_op] = _per_output(1)
for _op in ("Exp", "Log", "Sqrt", "Pow", "Erf", "Sigmoid", "Tanh", "Gelu", "Softplus",
            "Softsign", "Mish", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
            "Asinh", "Acosh", "Atanh"):
    _RULES[_op] = _per_output(4)
for _op in ("Reshape", "Flatten", "Transpose", "Concat", "Split", "Slice", "Squeeze",
            "Unsqueeze", "Identity", "Shape", "Size", "Gather", "GatherElements", "GatherND",
            "Cast", "CastLike", "Constant", "ConstantOfShape", "Expand", "Tile", "Pad",
            "Dropout", "Range", "DepthToSpace", "SpaceToDepth", "ScatterND", "ScatterElements",
            "OneHot", "NonZero", "EyeLike", "Trilu", "ReverseSequence", "Compress",
            "QuantizeLinear", "DequantizeLinear"):
    _RULES[_op] = _zero

KNOWN_OPS: frozenset[str] = frozenset(_RULES)


def cross_bytes(ga: GraphAnalysis) -> list[int]:
    """Bytes of activations alive between node i-1 and node i, for i in 0..len(nodes).

    Entry 0 is the model input, entry n the model output; entry i (0<i<n) is the
    size of the cut after the first i nodes of the topological order.
    """
    hit = ga.memo.get("cross")
    if isinstance(hit, list):
        return hit
    n = len(ga.nodes)
    diff = [0] * (n + 2)
    for name, b in ga.birth.items():
        end = ga.last_use.get(name)
        if end is None or end <= b:
            continue
        size = ga.tensors[name].nbytes
        diff[b + 1] += size
        diff[end + 1] -= size
    out, acc = [], 0
    for i in range(n + 1):
        acc += diff[i]
        out.append(acc)
    ga.memo["cross"] = out
    return out


def profile_model(src: ModelSource) -> ModelProfile:
    """Profile every node of a model (path, bytes, proto or GraphAnalysis)."""
    ga = analyze(src)
    hit = ga.memo.get("profile")
    if isinstance(hit, ModelProfile):
        return hit
    cross = cross_bytes(ga)
    tensors, static = ga.tensors, ga.static
    params = set(ga.initializers) | {
        o for node in ga.nodes if node.op_type == "Constant" for o in node.output
    }
    seen_params: set[str] = set()
    unknown: dict[str, None] = {}
    nodes: list[NodeProfile] = []
    for i, node in enumerate(ga.nodes):
        ins = [tensors.get(n) if n else None for n in node.input]
        outs = [tensors.get(n) if n else None for n in node.output]
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        rule = _RULES.get(op)
        if rule is None:
            if op not in unknown:
                warnings.warn(
                    f"unknown op {op} (node '{node.name or f'#{i}'}') counted as 0 FLOPs",
                    ProfileWarning, stacklevel=2,
                )
            unknown[op] = None
            flops, macs = 0, 0
        else:
            flops, macs = rule(node, ins, outs)
        p_bytes = 0
        for name in ga.node_inputs[i]:
            if name in params and name not in seen_params:
                seen_params.add(name)
                p_bytes += tensors[name].nbytes if name in tensors else 0
        in_bytes = sum(tensors[n].nbytes for n in set(ga.node_inputs[i]) if n not in static)
        out_bytes = sum(tensors[n].nbytes for n in node.output if n and n not in static)
        nodes.append(NodeProfile(
            index=i, name=node.name or f"{node.op_type}_{i}", op_type=op,
            flops=int(flops), macs=int(macs), param_bytes=p_bytes, input_bytes=in_bytes,
            output_bytes=out_bytes, live_bytes=cross[i] + out_bytes,
            inputs=tuple(node.input), outputs=tuple(node.output),
        ))
    result = ModelProfile(
        model=ga.name,
        nodes=tuple(nodes),
        flops=sum(n.flops for n in nodes),
        macs=sum(n.macs for n in nodes),
        param_bytes=sum(n.param_bytes for n in nodes),
        peak_activation_bytes=max((n.live_bytes for n in nodes), default=0),
        input_bytes=ga.input_bytes,
        output_bytes=sum(tensors[n].nbytes for n in ga.outputs),
        unknown_ops=tuple(unknown),
    )
    ga.memo["profile"] = result
    return result
