"""Load an ONNX model, infer shapes once, and index its graph for profiling and cutting.

Everything downstream (profile, cuts, partitions) works on a ``GraphAnalysis`` so
that a model is parsed, checked and shape-inferred exactly once.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np
import onnx
from google.protobuf.message import DecodeError as _ProtoDecodeError

from models.errors import ModelError

__all__ = [
    "GraphAnalysis",
    "ModelSource",
    "TensorInfo",
    "analyze",
    "load_model",
    "pin_dims",
]

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto, "GraphAnalysis"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Static shape and size of one tensor, from shape inference."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"
    nbytes: int

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True, slots=True, eq=False)
class GraphAnalysis:
    """A shape-inferred model with nodes in topological order and tensor lifetimes.

    ``birth[t]`` is the index of the node producing dynamic tensor ``t`` (-1 for a
    graph input); ``last_use[t]`` the last consuming node (``len(nodes)`` for a
    graph output). Static tensors (initializers, Constant-derived) never cross cuts:
    each partition that needs them carries its own copy.
    """

    model: onnx.ModelProto
    name: str
    nodes: tuple[onnx.NodeProto, ...]
    node_inputs: tuple[tuple[str, ...], ...]  # non-empty inputs, incl. subgraph captures
    tensors: Mapping[str, TensorInfo]
    initializers: frozenset[str]
    static: frozenset[str]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    birth: Mapping[str, int]
    last_use: Mapping[str, int]
    # Memo for derived results (profile, cuts): the analysis itself never changes.
    memo: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def input_bytes(self) -> int:
        return sum(self.tensors[n].nbytes for n in self.inputs)


def _label(src: object) -> str:
    if isinstance(src, (str, os.PathLike)):
        return str(src)
    return "model"


def _read(src: object, label: str) -> bytes:
    if isinstance(src, (str, os.PathLike)):
        try:
            data = Path(src).read_bytes()
        except FileNotFoundError:
            raise ModelError(f"{label}: no such file") from None
        except OSError as exc:
            raise ModelError(f"{label}: cannot read: {exc.strerror}") from None
    elif isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    else:
        raise ModelError(f"cannot load a model from {type(src).__name__}")
    if not data:
        raise ModelError(f"{label}: empty file, not an ONNX model")
    return data


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    try:
        return onnx.load_model_from_string(data)
    except (_ProtoDecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(f"{label}: not a valid ONNX file (truncated or corrupt): {exc}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check(model: onnx.ModelProto | bytes, label: str) -> None:
    """Run the ONNX checker (on bytes when we have them: no re-serialisation)."""
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        if isinstance(model, bytes):
            _parse(model, label)  # a parse failure gives the clearer message
        raise ModelError(f"{label}: invalid ONNX model: {_first_line(exc)}") from None


def load_model(src: ModelSource, *, dims: Mapping[str, int] | None = None) -> onnx.ModelProto:
    """Parse and check a model from a path, bytes or proto; bad input raises ModelError."""
    if isinstance(src, GraphAnalysis):
        return src.model
    label = _label(src)
    model = src if isinstance(src, onnx.ModelProto) else _parse(_read(src, label), label)
    if len(model.graph.node) == 0:
        raise ModelError(f"{label}: invalid ONNX model: the graph has no nodes")
    _check(model, label)
    if dims:
        model = pin_dims(model, dims)
    return model


def pin_dims(model: onnx.ModelProto, dims: Mapping[str, int]) -> onnx.ModelProto:
    """Return a copy whose graph inputs have the named symbolic dims fixed (e.g. N=1)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in out.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dims:
                value = int(dims[d.dim_param])
                if value <= 0:
                    raise ModelError(f"dimension {d.dim_param} must be positive, got {value}")
                d.dim_value = value
    # Stale inferred shapes would contradict the pinned ones.
    del out.graph.value_info[:]
    return out


_RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                     "RandomUniformLike", "Multinomial", "Bernoulli"})
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def _subgraph_captures(node: onnx.NodeProto) -> list[str]:
    """Outer-scope names a control-flow node reads implicitly through its subgraphs."""
    captured: list[str] = []
    for attr in node.attribute:
        graphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
        for g in graphs:
            if not g.node:
                continue
            local = {i.name for i in g.input} | {i.name for i in g.initializer}
            for sub in g.node:
                for name in list(sub.input) + _subgraph_captures(sub):
                    if name and name not in local:
                        captured.append(name)
                local.update(o for o in sub.output if o)
    return captured


def _toposort(nodes: list[onnx.NodeProto], ins: list[tuple[str, ...]],
              available: set[str]) -> list[int]:
    """Kahn's algorithm, stable on the file order (which usually is topological already)."""
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for o in node.output:
            if o:
                producer[o] = i
    deps: list[set[int]] = []
    users: list[list[int]] = [[] for _ in nodes]
    for i, names in enumerate(ins):
        d = {producer[n] for n in names if n in producer and n not in available}
        deps.append(d)
        for j in d:
            users[j].append(i)
    if all(max(d, default=-1) < i for i, d in enumerate(deps)):
        return list(range(len(nodes)))
    import heapq

    pending = [len(d) for d in deps]
    ready = [i for i, p in enumerate(pending) if p == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise ModelError("invalid ONNX model: the graph has a cycle")
    return order


def _tensor_info(vi: onnx.ValueInfoProto, where: str) -> TensorInfo:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise ModelError(f"tensor '{vi.name}' ({where}) is not a dense tensor; unsupported")
    if not tt.HasField("shape"):
        raise ModelError(f"tensor '{vi.name}' ({where}) has no inferred shape")
    shape: list[int] = []
    for d in tt.shape.dim:
        v = d.dim_value
        if v > 0 or d.HasField("dim_value"):
            shape.append(v)
        else:
            sym = d.dim_param or "?"
            raise ModelError(
                f"dynamic shape: tensor '{vi.name}' ({where}) has dimension '{sym}'; "
                f"pin it, e.g. dims={{'{sym}': 1}} (CLI: --dim {sym}=1)"
            )
    return _make_info(vi.name, tuple(shape), tt.elem_type)


_DTYPES: dict[int, tuple[str, int]] = {}


def _dtype(elem_type: int) -> tuple[str, int]:
    """numpy dtype name and item size of an ONNX element type (cached: it is hot)."""
    hit = _DTYPES.get(elem_type)
    if hit is None:
        try:
            dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
            # strings have no fixed size; count them as empty
            hit = (dt.name, 0 if dt.kind == "O" else dt.itemsize)
        except (KeyError, TypeError, ValueError):
            hit = (onnx.TensorProto.DataType.Name(elem_type).lower(), 0)
        _DTYPES[elem_type] = hit
    return hit


def _make_info(name: str, shape: tuple[int, ...], elem_type: int) -> TensorInfo:
    dtype, itemsize = _dtype(elem_type)
    return TensorInfo(name, shape, dtype, math.prod(shape) * itemsize)


def analyze(src: ModelSource, *, dims: Mapping[str, int] | None = None) -> GraphAnalysis:
    """Load, check and shape-infer a model once; raises ModelError on bad or dynamic input."""
    if isinstance(src, GraphAnalysis):
        return src
    label = _label(src)
    source: onnx.ModelProto | bytes
    if isinstance(src, onnx.ModelProto) or dims:
        source = load_model(src, dims=dims)
        model_name = source.graph.name
    else:
        # Fast path for files and bytes: check and infer straight from the bytes,
        # parsing only the inferred result (a 2.4 MB model parses in milliseconds).
        source = _read(src, label)
        _check(source, label)
        model_name = ""
    try:
        inferred = onnx.shape_inference.infer_shapes(source, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError,
            RuntimeError) as exc:
        raise ModelError(f"{label}: shape inference failed: {_first_line(exc)}") from None
    if len(inferred.graph.node) == 0:
        raise ModelError(f"{label}: invalid ONNX model: the graph has no nodes")
    g = inferred.graph
    model_name = model_name or g.name
    raw_nodes = list(g.node)
    raw_ins = [tuple(n for n in node.input if n)
               + (tuple(_subgraph_captures(node)) if node.op_type in _CONTROL_FLOW else ())
               for node in raw_nodes]
    initializers = frozenset(t.name for t in g.initializer)
    inputs = tuple(vi.name for vi in g.input if vi.name not in initializers)
    order = _toposort(raw_nodes, raw_ins, set(inputs) | initializers)
    if order != list(range(len(raw_nodes))):
        # Partition extraction keeps the file's node order, so store the sorted one.
        sorted_nodes = [raw_nodes[i] for i in order]
        del g.node[:]
        g.node.extend(sorted_nodes)
    nodes = tuple(g.node)
    node_inputs = tuple(raw_ins[i] for i in order)

    vis: dict[str, onnx.ValueInfoProto] = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        vis[vi.name] = vi
    tensors: dict[str, TensorInfo] = {}
    for t in g.initializer:
        tensors[t.name] = _make_info(t.name, tuple(int(d) for d in t.dims), t.data_type)
    for name in inputs:
        tensors[name] = _tensor_info(vis[name], "graph input")

    static: set[str] = set(initializers)
    birth: dict[str, int] = {n: -1 for n in inputs}
    last_use: dict[str, int] = {}
    known = set(inputs) | initializers
    for i, node in enumerate(nodes):
        for name in node_inputs[i]:
            if name not in known:
                raise ModelError(
                    f"{label}: invalid ONNX model: node '{node.name or node.op_type}' reads "
                    f"undefined tensor '{name}'"
                )
            if name not in static:
                last_use[name] = i
        # Random ops are not constants: copying them into each partition would diverge.
        is_static = node.op_type not in _RANDOM and all(n in static for n in node_inputs[i])
        for o in node.output:
            if not o:
                continue
            known.add(o)
            if is_static:
                static.add(o)
                if o in vis and vis[o].type.tensor_type.HasField("shape"):
                    try:
                        tensors[o] = _tensor_info(vis[o], f"output of {node.op_type}")
                    except ModelError:
                        pass  # static values never cross cuts; their size is informative only
                continue
            birth[o] = i
            if o not in vis:
                raise ModelError(
                    f"{label}: tensor '{o}' (output of {node.op_type} "
                    f"'{node.name or '?'}') has no inferred shape; unknown op or bad attributes"
                )
            tensors[o] = _tensor_info(vis[o], f"output of {node.op_type} '{node.name or '?'}'")
    outputs = tuple(vi.name for vi in g.output)
    n = len(nodes)
    for name in outputs:
        if name in static:
            raise ModelError(f"{label}: graph output '{name}' is a constant; unsupported")
        last_use[name] = n
        if name not in tensors:
            tensors[name] = _tensor_info(vis[name], "graph output")
    return GraphAnalysis(
        model=inferred,
        name=model_name or "model",
        nodes=nodes,
        node_inputs=node_inputs,
        tensors=tensors,
        initializers=initializers,
        static=frozenset(static),
        inputs=inputs,
        outputs=outputs,
        birth=birth,
        last_use=last_use,
    )


def dynamic_names(names: Iterable[str], ga: GraphAnalysis) -> list[str]:
    """The names that are activations (not weights or constants), in order."""
    return [n for n in names if n not in ga.static]
