"""Reference models built locally with onnx.helper and seeded weights (nothing downloaded).

Each builder returns a checked ``onnx.ModelProto`` (opset 17, IR 8 so any
onnxruntime >= 1.14 runs it) with input ``x`` and one output. They cover the cut
shapes the broker must handle: a plain chain (mlp), residual skips (resnet, deep),
parallel branches joined by Concat (inception) and attention (transformer).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.errors import ModelError

__all__ = ["NAMES", "OPSET", "IR_VERSION", "build", "mlp_from_weights"]

OPSET = 17
IR_VERSION = 8


class _Builder:
    """Accumulates nodes and seeded initializers with unique, readable names."""

    __slots__ = ("_count", "inits", "nodes", "rng")

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count: dict[str, int] = {}

    def _fresh(self, stem: str) -> str:
        k = self._count.get(stem, 0)
        self._count[stem] = k + 1
        return f"{stem}_{k}"

    def const(self, stem: str, value: np.ndarray) -> str:
        name = self._fresh(stem)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def weight(self, stem: str, shape: Sequence[int], fan_in: int, gain: float = 1.0) -> str:
        w = self.rng.normal(0.0, gain * np.sqrt(2.0 / fan_in), size=tuple(shape))
        return self.const(stem, w.astype(np.float32))

    def bias(self, stem: str, n: int) -> str:
        return self.const(stem, (0.01 * self.rng.normal(size=n)).astype(np.float32))

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None,
           **attrs: Any) -> str:
        name = self._fresh(op_type.lower())
        output = out or f"{name}_out"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=name, **attrs))
        return output

    # Composite layers -----------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1,
             gain: float = 1.0) -> str:
        w = self.weight("conv_w", (cout, cin, k, k), cin * k * k, gain)
        b = self.bias("conv_b", cout)
        p = k // 2
        return self.op("Conv", [x, w, b], kernel_shape=[k, k], strides=[stride, stride],
                       pads=[p, p, p, p])

    def bn(self, x: str, c: int) -> str:
        r = self.rng
        scale = self.const("bn_scale", (1.0 + 0.1 * r.normal(size=c)).astype(np.float32))
        shift = self.const("bn_shift", (0.05 * r.normal(size=c)).astype(np.float32))
        mean = self.const("bn_mean", (0.05 * r.normal(size=c)).astype(np.float32))
        var = self.const("bn_var", (1.0 + 0.2 * r.random(size=c)).astype(np.float32))
        return self.op("BatchNormalization", [x, scale, shift, mean, var], epsilon=1e-5)

    def conv_bn_relu(self, x: str, cin: int, cout: int, k: int, stride: int = 1) -> str:
        return self.op("Relu", [self.bn(self.conv(x, cin, cout, k, stride), cout)])

    def dense(self, x: str, fin: int, fout: int, gain: float = 1.0) -> str:
        """MatMul + Add: works on any rank, unlike Gemm."""
        w = self.weight("dense_w", (fin, fout), fin, gain)
        return self.op("Add", [self.op("MatMul", [x, w]), self.bias("dense_b", fout)])

    def layer_norm(self, x: str, d: int) -> str:
        g = self.const("ln_g", (1.0 + 0.05 * self.rng.normal(size=d)).astype(np.float32))
        b = self.const("ln_b", (0.02 * self.rng.normal(size=d)).astype(np.float32))
        return self.op("LayerNormalization", [x, g, b], axis=-1, epsilon=1e-5)

    def model(self, graph_name: str, x_shape: Sequence[int | str], out: str,
              out_shape: Sequence[int | str]) -> onnx.ModelProto:
        """The graph built so far as a checked model; a ``str`` dimension is symbolic (``"N"``)."""
        graph = helper.make_graph(
            self.nodes, graph_name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, list(out_shape))],
            initializer=self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  ir_version=IR_VERSION, producer_name="fogline.models.zoo")
        onnx.checker.check_model(model)
        return model


def mlp_from_weights(weights: Sequence[np.ndarray], *, batch: int | None = 1,
                     name: str = "mlp") -> onnx.ModelProto:
    """Gemm-Relu-Gemm (or a single Gemm for 2 arrays) with the trainer's weight layout.

    ``weights`` is ``[W1 (in,h), b1 (h), W2 (h,out), b2 (out)]`` or ``[W (in,out), b]``;
    ``batch=None`` gives a symbolic batch dimension ``N``.
    """
    if len(weights) not in (2, 4):
        raise ModelError(f"expected 2 or 4 weight arrays, got {len(weights)}")
    arrays = [np.asarray(w, dtype=np.float32) for w in weights]
    for i in range(0, len(arrays), 2):
        w, b = arrays[i], arrays[i + 1]
        if w.ndim != 2 or b.shape != (w.shape[1],):
            raise ModelError(f"layer {i // 2}: weight {w.shape} and bias {b.shape} do not match")
    bld = _Builder(0)
    x = "x"
    n_layers = len(arrays) // 2
    for layer in range(n_layers):
        w_name = bld.const(f"fc{layer + 1}_w", arrays[2 * layer])
        b_name = bld.const(f"fc{layer + 1}_b", arrays[2 * layer + 1])
        last = layer == n_layers - 1
        x = bld.op("Gemm", [x, w_name, b_name], out="logits" if last else None)
        if not last:
            x = bld.op("Relu", [x])
    dim: int | str = "N" if batch is None else batch
    return bld.model(name, [dim, arrays[0].shape[0]], "logits", [dim, arrays[-1].shape[0]])


def _mlp(*, hidden: int = 32, inputs: int = 64, classes: int = 10, batch: int = 1,
         seed: int = 0) -> onnx.ModelProto:
    """The 8x8-digits MLP: 64 -> hidden -> 10, He-initialised from ``seed``."""
    rng = np.random.default_rng(seed)
    weights = [
        rng.normal(0, np.sqrt(2 / inputs), (inputs, hidden)),
        np.zeros(hidden),
        rng.normal(0, np.sqrt(2 / hidden), (hidden, classes)),
        np.zeros(classes),
    ]
    return mlp_from_weights(weights, batch=batch, name="mlp")


def _resnet(*, widths: Sequence[int] = (16, 32, 64), blocks: int = 1, classes: int = 10,
            batch: int = 1, size: int = 32, seed: int = 0) -> onnx.ModelProto:
    """ResNet-like CNN on 3x32x32: stem, residual stages (stride 2 + 1x1 projection), head."""
    b = _Builder(seed)
    x = b.conv_bn_relu("x", 3, widths[0], 3)
    cin, hw = widths[0], size
    for stage, cout in enumerate(widths):
        for blk in range(blocks):
            stride = 2 if stage > 0 and blk == 0 else 1
            y = b.conv_bn_relu(x, cin, cout, 3, stride)
            y = b.bn(b.conv(y, cout, cout, 3, gain=0.5), cout)
            skip = x if stride == 1 and cin == cout else b.bn(b.conv(x, cin, cout, 1, stride), cout)
            x = b.op("Relu", [b.op("Add", [y, skip])])
            cin = cout
            hw = (hw + stride - 1) // stride
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    w = b.weight("fc_w", (cin, classes), cin)
    x = b.op("Gemm", [x, w, b.bias("fc_b", classes)], out="logits")
    return b.model("resnet", [batch, 3, size, size], "logits", [batch, classes])


def _inception(*, modules: int = 2, width: int = 16, classes: int = 10, batch: int = 1,
               size: int = 32, seed: int = 0) -> onnx.ModelProto:
    """Inception-like DAG: four parallel branches (1x1, 3x3, double 3x3, pool) joined by Concat."""
    b = _Builder(seed)
    c = width
    x = b.conv_bn_relu("x", 3, c, 3, stride=2)
    for _ in range(modules):
        q = max(c // 4, 4)
        b1 = b.op("Relu", [b.conv(x, c, q, 1)])
        b2 = b.op("Relu", [b.conv(b.op("Relu", [b.conv(x, c, q, 1)]), q, q, 3)])
        b3 = b.op("Relu", [b.conv(x, c, q, 1)])
        b3 = b.op("Relu", [b.conv(b3, q, q, 3)])
        b3 = b.op("Relu", [b.conv(b3, q, q, 3)])
        b4 = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
        b4 = b.op("Relu", [b.conv(b4, c, q, 1)])
        x = b.op("Concat", [b1, b2, b3, b4], axis=1)
        c = 4 * q
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    w = b.weight("fc_w", (c, classes), c)
    x = b.op("Gemm", [x, w, b.bias("fc_b", classes)], out="logits")
    return b.model("inception", [batch, 3, size, size], "logits", [batch, classes])


def _transformer(*, seq: int = 16, d_model: int = 32, heads: int = 4, ff: int = 64,
                 layers: int = 1, batch: int = 1, seed: int = 0) -> onnx.ModelProto:
    """Pre-LN transformer encoder block(s): attention + GELU MLP, each with a residual Add."""
    if d_model % heads:
        raise ModelError(f"d_model {d_model} is not divisible by heads {heads}")
    b = _Builder(seed)
    dh = d_model // heads
    x = "x"
    split = b.const("shape_heads", np.array([batch, seq, heads, dh], np.int64))
    merge = b.const("shape_merge", np.array([batch, seq, d_model], np.int64))
    scale = b.const("attn_scale", np.array(1.0 / np.sqrt(dh), np.float32))
    for layer in range(layers):
        h = b.layer_norm(x, d_model)
        q, k, v = (b.op("MatMul", [h, b.weight(f"w{t}", (d_model, d_model), d_model, 0.7)])
                   for t in "qkv")
        q = b.op("Transpose", [b.op("Reshape", [q, split])], perm=[0, 2, 1, 3])
        k = b.op("Transpose", [b.op("Reshape", [k, split])], perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [v, split])], perm=[0, 2, 1, 3])
        att = b.op("Softmax", [b.op("Mul", [b.op("MatMul", [q, k]), scale])], axis=-1)
        ctx = b.op("Transpose", [b.op("MatMul", [att, v])], perm=[0, 2, 1, 3])
        ctx = b.dense(b.op("Reshape", [ctx, merge]), d_model, d_model, 0.5)
        x = b.op("Add", [x, ctx])
        h = b.dense(b.layer_norm(x, d_model), d_model, ff, 0.7)
        # GELU(h) = 0.5 h (1 + erf(h / sqrt 2)); opset 17 has no Gelu op.
        e = b.op("Erf", [b.op("Div", [h, b.const("sqrt2", np.array(np.sqrt(2), np.float32))])])
        e = b.op("Add", [e, b.const("one", np.array(1.0, np.float32))])
        h = b.op("Mul", [b.op("Mul", [h, e]), b.const("half", np.array(0.5, np.float32))])
        h = b.dense(h, ff, d_model, 0.5)
        x = b.op("Add", [x, h], out="y" if layer == layers - 1 else None)
    return b.model("transformer", [batch, seq, d_model], "y", [batch, seq, d_model])


def _deep(*, blocks: int = 72, width: int = 64, batch: int = 1,
          seed: int = 0) -> onnx.ModelProto:
    """Synthetic deep residual MLP: 7 nodes per block + 1 head, 505 nodes by default."""
    b = _Builder(seed)
    x = "x"
    for _ in range(blocks):
        h = b.op("Relu", [b.dense(x, width, width)])
        h = b.dense(h, width, width, gain=0.1)
        x = b.op("Relu", [b.op("Add", [h, x])])
    w = b.weight("head_w", (width, 10), width)
    b.op("MatMul", [x, w], out="logits")
    return b.model("deep", [batch, width], "logits", [batch, 10])


_BUILDERS: dict[str, Callable[..., onnx.ModelProto]] = {
    "mlp": _mlp,
    "resnet": _resnet,
    "inception": _inception,
    "transformer": _transformer,
    "deep": _deep,
}
NAMES: tuple[str, ...] = tuple(_BUILDERS)


def build(name: str, **kw: Any) -> onnx.ModelProto:
    """Build the named reference model; keyword arguments tune its size and seed."""
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ModelError(f"unknown zoo model {name!r}; choose from {', '.join(NAMES)}") from None
    try:
        return builder(**kw)
    except TypeError as exc:
        raise ModelError(f"zoo model {name!r}: {exc}") from None
