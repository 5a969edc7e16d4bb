"""Load an ONNX model, size every tensor once, and index its graph for profiling and cutting.

Everything downstream (profile, cuts, partitions) works on a ``GraphAnalysis`` so
that a model is parsed, checked and sized exactly once. Inputs get fixed shapes
(``dims``, ``input_shapes``); activations are sized by static shape inference
where it is exact, and otherwise by one onnxruntime run, which also sizes
data-dependent Reshape/Range/NonZero chains and If/Loop/Scan outputs. That run is
the caller's: it passes a ``probe`` (``models.probe.run_shapes``, the shell), so
this module and everything built on it (profile, cuts, partition) never runs a model.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, Union

import numpy as np
import onnx
from google.protobuf.message import DecodeError as _ProtoDecodeError

from models.errors import ModelError
from models.external import external_tensors, inline_only, uses_external_data
from models.feeds import make_feeds

__all__ = [
    "GraphAnalysis",
    "InputShapes",
    "ModelFile",
    "ModelSource",
    "ProbeFn",
    "ShapeSource",
    "SideFiles",
    "TensorInfo",
    "analyze",
    "load_model",
    "pin_dims",
    "serving_dims",
    "set_input_shapes",
    "type_from_ort",
    "uses_external_data",
]

ModelSource = Union[bytes, onnx.ModelProto, "GraphAnalysis", "ModelFile"]
InputShapes = Mapping[str, Sequence[int]]
ShapeSource = Literal["auto", "run", "static"]


class ProbeFn(Protocol):
    """One run of ``model`` on ``feeds`` sizing tensors ``names``: {name: (shape, dtype name, nbytes)}.

    ``external_dir`` is where the model's external data files are (None: nowhere).
    ``models.probe.run_shapes`` is the one the shells pass; tests pass fakes.
    """

    def __call__(self, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                 names: Sequence[str], *, external_dir: str | None = None,
                 ) -> Mapping[str, tuple[tuple[int, ...], str, int]]: ...


class SideFiles(Protocol):
    """The disk behind a model file, passed in by its shell (``models.graph_files``).

    The core never opens a file: the checker, the side-file rule and the weights kept in side
    files (ONNX external data) all go through this. Raises ModelError (one line) on bad files.
    """

    @property
    def directory(self) -> str:
        """Where the side files are (the model file's resolved directory)."""

    def check(self) -> None:
        """The ONNX checker on the file itself (side files found next to it)."""

    def check_location(self, location: str, tensor: str, label: str) -> None:
        """Refuse ``location`` unless it is a regular side file in ``directory``."""

    def load(self, tensor: onnx.TensorProto, location: str, label: str) -> None:
        """Read ``tensor``'s external data from its side file into it."""


@dataclass(frozen=True, slots=True)
class ModelFile:
    """A model file as its shell read it: bytes to parse and the disk behind them."""

    data: bytes
    label: str
    files: SideFiles


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Static shape and size of one tensor, from shape inference."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"
    nbytes: int

    @property
    def dense(self) -> bool:
        """False for a sequence or a map (dtype is then onnxruntime's type string)."""
        return not self.dtype.startswith(("seq(", "map(", "optional("))

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


def type_from_ort(text: str) -> onnx.TypeProto:
    """An ONNX type from onnxruntime's type string: ``seq(map(int64,tensor(float)))``."""
    text = text.strip()
    head, _, rest = text.partition("(")
    inner = rest[:-1] if rest.endswith(")") else ""
    out = onnx.TypeProto()
    try:
        if head == "tensor":
            out.tensor_type.elem_type = onnx.TensorProto.DataType.Value(inner.upper())
        elif head == "seq":
            out.sequence_type.elem_type.CopyFrom(type_from_ort(inner))
        elif head == "optional":
            out.optional_type.elem_type.CopyFrom(type_from_ort(inner))
        elif head == "map":
            key, _, value = inner.partition(",")
            out.map_type.key_type = onnx.TensorProto.DataType.Value(key.strip().upper())
            out.map_type.value_type.CopyFrom(type_from_ort(value))
        else:
            raise ValueError(head)
    except ValueError:
        raise ModelError(f"unsupported value type {text!r}") from None
    return out


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
    # Where activation sizes came from: "static" shape inference or one onnxruntime "run".
    shape_source: str = "static"
    # Types as the model itself declares or implies them before ``dims``/``input_shapes``
    # fixed its inputs. Partitions declare these on their inputs and outputs, so they
    # accept what the exported model accepts; fixed shapes there can also break
    # onnxruntime's inference of an untaken If branch (Silero VAD's 8 kHz branch).
    declared: Mapping[str, onnx.ValueInfoProto] = field(default_factory=dict, repr=False)
    # Where the weights kept in side files (ONNX external data) live; '' when inline.
    # They are never read whole: each partition loads only the initializers it holds.
    external_dir: str = ""
    # How to read them (None: bytes or a proto, whose locations are nobody's files).
    side_files: SideFiles | None = field(default=None, repr=False)

    @property
    def input_bytes(self) -> int:
        return sum(self.tensors[n].nbytes for n in self.inputs)


def _label(src: object) -> str:
    if isinstance(src, ModelFile):
        return src.label
    return "model"


def _read(src: object, label: str) -> bytes:
    if isinstance(src, ModelFile):
        data = src.data
    elif isinstance(src, (str, os.PathLike)):
        raise ModelError(f"{os.fspath(src)}: a path is read by a shell: pass "
                         f"models.graph_files.open_model(path) or use models.probe.analyze")
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


def _check(model: onnx.ModelProto | bytes, label: str, files: SideFiles | None = None) -> None:
    """Run the ONNX checker (on bytes when we have them: no re-serialisation).

    With ``files``, the checker runs on the file itself through its shell, so weights kept
    in side files (ONNX external data) are found next to it, not in the working directory.
    """
    try:
        if files is not None:
            files.check()
        else:
            onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        if isinstance(model, bytes):
            _parse(model, label)  # a parse failure gives the clearer message
        raise ModelError(f"{label}: invalid ONNX model: {_first_line(exc)}") from None


def _files_of(src: object) -> SideFiles | None:
    return src.files if isinstance(src, ModelFile) else None


def _external_dir(model: onnx.ModelProto, src: object, label: str) -> str:
    """The directory holding the model's external data files ('' when it has none).

    Side files are read only next to a model file given by its path, and each must be a
    regular file in that directory (``models.external``). A model given as bytes or a proto
    names no file: resolved, its locations would be paths in the working directory of the
    process (``/`` for the fog broker), so it is refused.
    """
    ext = external_tensors(model)
    if not ext:
        return ""
    files = _files_of(src)
    if files is None:
        raise ModelError(inline_only(label, ext[0].name))
    inner = next((e for e in ext if not e.initializer), None)
    if inner is not None:
        raise ModelError(f"{label}: tensor {inner.name[:64]!r} outside the graph's initializers "
                         f"(a node attribute or a subgraph) keeps its data in an external file; "
                         f"unsupported: only initializers may")
    for e in ext:
        files.check_location(e.location, e.name, label)
    return files.directory


def load_model(src: ModelSource, *, dims: Mapping[str, int] | None = None,
               input_shapes: InputShapes | None = None) -> onnx.ModelProto:
    """Parse and check a model from bytes, a proto or a ``ModelFile``; bad input raises ModelError.

    ``dims`` pins named symbolic dims of the inputs, ``input_shapes`` gives whole input
    shapes (anonymous ``?`` dims included); both return a copy.
    """
    if isinstance(src, GraphAnalysis):
        return src.model
    label = _label(src)
    model = src if isinstance(src, onnx.ModelProto) else _parse(_read(src, label), label)
    if len(model.graph.node) == 0:
        raise ModelError(f"{label}: invalid ONNX model: the graph has no nodes")
    _check(model, label, _files_of(src))
    if dims:
        model = pin_dims(model, dims)
    if input_shapes:
        model = set_input_shapes(model, input_shapes)
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


def serving_dims(model: onnx.ModelProto, input_shapes: InputShapes | None = None
                 ) -> dict[str, int]:
    """Named symbolic dims to pin at 1 (one request at a time, as the fog broker serves).

    Only dims of inputs whose whole shape is not given, and never a name that a given
    shape also fixes (``--input-shape`` wins over the default).
    """
    given = set(input_shapes or ())
    inits = {t.name for t in model.graph.initializer}
    fixed_by_shape = {d.dim_param for vi in model.graph.input if vi.name in given
                      for d in vi.type.tensor_type.shape.dim if d.dim_param}
    return {d.dim_param: 1 for vi in model.graph.input
            if vi.name not in given and vi.name not in inits
            for d in vi.type.tensor_type.shape.dim
            if d.dim_param and not _fixed(d) and d.dim_param not in fixed_by_shape}


def _fixed(d: onnx.TensorShapeProto.Dimension) -> bool:
    # Some exporters write -1 for "any size" (PaddlePaddle's batch dim).
    return d.HasField("dim_value") and d.dim_value >= 0


def _dim_text(d: onnx.TensorShapeProto.Dimension) -> str:
    return str(d.dim_value) if _fixed(d) else (d.dim_param or "?")


def _shape_text(vi: onnx.ValueInfoProto) -> str:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return "unknown rank"
    return "[" + ", ".join(_dim_text(d) for d in tt.shape.dim) + "]"


def _spec_text(shapes: Mapping[str, Sequence[int]]) -> str:
    return " ".join(f"{n}={','.join(str(v) for v in s) or 'scalar'}" for n, s in shapes.items())


def set_input_shapes(model: onnx.ModelProto, input_shapes: InputShapes) -> onnx.ModelProto:
    """Return a copy with whole input shapes fixed, e.g. ``{"x": [1, 3, 48, 320]}``.

    Every named input must exist; a shape must have the input's rank and agree with
    its fixed dims. Symbolic and anonymous (``?``) dims take the given values.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name for t in g.initializer}
    by_name = {vi.name: vi for vi in g.input if vi.name not in inits}
    for name, shape in input_shapes.items():
        vi = by_name.get(name)
        if vi is None:
            raise ModelError(f"input shape for '{name}': the model has no input '{name}' "
                             f"(its inputs: {', '.join(by_name) or 'none'})")
        try:
            if isinstance(shape, (str, bytes)):
                raise TypeError
            dims = [int(v) for v in shape]
        except (TypeError, ValueError):
            raise ModelError(f"input shape for '{name}' must be a list of integers, "
                             f"got {shape!r}") from None
        if any(v <= 0 for v in dims):
            raise ModelError(f"input shape for '{name}': dimensions must be positive, got {dims}")
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"input '{name}' is not a dense tensor; unsupported")
        tt = vi.type.tensor_type
        given = _spec_text({name: dims})
        if tt.HasField("shape"):
            old = tt.shape.dim
            if len(old) != len(dims):
                raise ModelError(f"input shape {given} does not match the model: input "
                                 f"'{name}' has {len(old)} dimensions {_shape_text(vi)}, "
                                 f"not {len(dims)}")
            for k, (d, v) in enumerate(zip(old, dims)):
                if _fixed(d) and d.dim_value != v:
                    raise ModelError(f"input shape {given} does not match the model: dimension "
                                     f"{k} of input '{name}' is fixed at {d.dim_value} "
                                     f"{_shape_text(vi)}")
        tt.shape.Clear()
        for v in dims:
            tt.shape.dim.add().dim_value = v
    del g.value_info[:]
    return out


def _require_fixed_inputs(g: onnx.GraphProto, inputs: Sequence[str], label: str) -> None:
    """Every input dimension must be known before shapes can be computed."""
    vis = {vi.name: vi for vi in g.input}
    for name in inputs:
        vi = vis[name]
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"{label}: input '{name}' is not a dense tensor; unsupported")
        tt = vi.type.tensor_type
        hint = f"(Python: input_shapes={{'{name}': [...]}})"
        if not tt.HasField("shape"):
            raise ModelError(f"dynamic shape: tensor '{name}' (graph input) has no shape; "
                             f"give it with --input-shape {name}=D0,D1,... {hint}")
        dims = tt.shape.dim
        for d in dims:
            if _fixed(d):
                continue
            sym = d.dim_param or "?"
            example = ",".join(str(e.dim_value) if _fixed(e) else f"D{k}"
                               for k, e in enumerate(dims))
            pin = f" or --dim {sym}=INT" if d.dim_param else ""
            raise ModelError(
                f"dynamic shape: tensor '{name}' (graph input) has dimension '{sym}' in "
                f"{_shape_text(vi)}; give its shape with --input-shape {name}={example}"
                f"{pin} {hint}"
            )


_RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                     "RandomUniformLike", "Multinomial", "Bernoulli"})


def _subgraph_captures(node: onnx.NodeProto) -> list[str]:
    """Outer-scope names a node reads implicitly through its subgraphs (If, Loop, Scan, ...).

    Recursive: a capture of a nested subgraph that the enclosing subgraph does not
    define is a capture of this node too. Such a node stays whole inside one segment,
    and every name it captures is an input of that segment.
    """
    captured: dict[str, None] = {}
    for attr in node.attribute:
        graphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
        for g in graphs:
            local = ({i.name for i in g.input} | {i.name for i in g.initializer}
                     | {i.values.name for i in g.sparse_initializer})
            for sub in g.node:
                for name in list(sub.input) + _subgraph_captures(sub):
                    if name and name not in local:
                        captured[name] = None
                local.update(o for o in sub.output if o)
            # A subgraph may return an outer value untouched.
            for o in g.output:
                if o.name and o.name not in local:
                    captured[o.name] = None
    return list(captured)


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


def _static_info(vi: onnx.ValueInfoProto | None) -> TensorInfo | None:
    """The tensor's size when static inference fixed every dimension, else None."""
    if vi is None or not vi.type.HasField("tensor_type"):
        return None
    tt = vi.type.tensor_type
    if not tt.HasField("shape") or tt.elem_type == 0:
        return None
    shape: list[int] = []
    for d in tt.shape.dim:
        if not _fixed(d):
            return None
        shape.append(d.dim_value)
    return _make_info(vi.name, tuple(shape), tt.elem_type)


def _unsized(vi: onnx.ValueInfoProto, where: str) -> str:
    """Why static inference gave no size (the message when no run may fill it in)."""
    what = f"tensor '{vi.name}' ({where})"
    kind = vi.type.WhichOneof("value")
    if kind is None or (kind == "tensor_type" and not vi.type.tensor_type.HasField("shape")):
        return f"{what} has no inferred shape"
    if kind != "tensor_type":
        return f"{what} is not a dense tensor; unsupported"
    sym = next((d.dim_param or "?" for d in vi.type.tensor_type.shape.dim if not _fixed(d)), "?")
    return f"dynamic shape: {what} has dimension '{sym}'"


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


def _dropout_mask(node: onnx.NodeProto, name: str, tensors: Mapping[str, TensorInfo],
                  opset: int) -> TensorInfo | None:
    """Dropout's optional mask, which onnx's inference leaves untyped: the data's shape.

    By the operator's definition: dtype T (the data's) up to opset 9, bool from 10.
    """
    data = tensors.get(node.input[0]) if node.input else None
    if data is None:
        return None
    if opset >= 10:
        return TensorInfo(name, data.shape, "bool", math.prod(data.shape))
    return TensorInfo(name, data.shape, data.dtype, data.nbytes)


def _input_values(model: onnx.ModelProto, values: Mapping[str, object],
                  shapes: InputShapes | None) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
    """Check ``input_values`` names; the shapes they imply for still-dynamic inputs."""
    inits = {t.name for t in model.graph.initializer}
    vis = {vi.name: vi for vi in model.graph.input if vi.name not in inits}
    arrays: dict[str, np.ndarray] = {}
    implied: dict[str, list[int]] = {}
    for name, value in values.items():
        vi = vis.get(name)
        if vi is None:
            raise ModelError(f"input value for '{name}': the model has no input '{name}' "
                             f"(its inputs: {', '.join(vis) or 'none'})")
        arr = np.asarray(value)
        arrays[name] = arr
        dims = vi.type.tensor_type.shape.dim
        dynamic = not vi.type.tensor_type.HasField("shape") or not all(_fixed(d) for d in dims)
        if dynamic and arr.ndim and (shapes is None or name not in shapes):
            implied[name] = list(arr.shape)
    return arrays, implied


def _probe_feeds(g: onnx.GraphProto, inputs: Sequence[str],
                 values: Mapping[str, np.ndarray], label: str) -> dict[str, np.ndarray]:
    vis = {vi.name: vi for vi in g.input}
    spec: dict[str, tuple[tuple[int, ...], int]] = {}
    for name in inputs:
        tt = vis[name].type.tensor_type
        shape = tuple(d.dim_value for d in tt.shape.dim)
        spec[name] = (shape, tt.elem_type)
        if name in values and values[name].size != math.prod(shape):
            raise ModelError(f"{label}: input value for '{name}' has {values[name].size} "
                             f"element(s), but input '{name}' has shape {list(shape)}")
    try:
        return make_feeds(spec, values)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{label}: bad input value: {_first_line(exc)}") from None


def _declared_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Tensor types static inference gives the model as exported (dynamic dims left open)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError):
        inferred = model  # then only its own declarations (graph inputs and outputs)
    g = inferred.graph
    return {vi.name: vi for vi in [*g.value_info, *g.input, *g.output]}


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.HasField("g") or len(a.graphs) for a in node.attribute)


def _restore_subgraphs(g: onnx.GraphProto, source: onnx.ModelProto | bytes, label: str) -> None:
    """Put back the exporter's own subgraphs (If/Loop/Scan bodies) in place of inferred ones.

    Static inference writes its guesses into subgraph value_info (for every branch,
    including one the inputs never take); onnxruntime then rejects a partition whose
    untaken branch was inferred from shapes it never sees. Outer nodes keep their order.
    """
    where = [i for i, node in enumerate(g.node) if _has_subgraph(node)]
    if not where:
        return
    original = source if isinstance(source, onnx.ModelProto) else _parse(source, label)
    for i in where:
        g.node[i].CopyFrom(original.graph.node[i])


_INFER_ERRORS = (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError)


def _infer(source: onnx.ModelProto | bytes, label: str) -> tuple[onnx.ModelProto, str]:
    """Static shape inference, strict first; the reason when it had to be relaxed.

    Exporters write graphs that strict inference rejects (an ``ai.onnx.ml`` op it
    cannot type, a custom-domain op without a schema) yet onnxruntime runs: then
    the lenient pass types what it can, and one run sizes the rest.
    """
    try:
        return onnx.shape_inference.infer_shapes(source, strict_mode=True, data_prop=True), ""
    except _INFER_ERRORS as exc:
        why = _first_line(exc)
    try:
        return onnx.shape_inference.infer_shapes(source, data_prop=True), why
    except _INFER_ERRORS:
        model = source if isinstance(source, onnx.ModelProto) else _parse(source, label)
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out, why


def analyze(src: ModelSource, *, dims: Mapping[str, int] | None = None,
            input_shapes: InputShapes | None = None,
            input_values: Mapping[str, object] | None = None,
            shapes: ShapeSource = "auto", probe: ProbeFn | None = None) -> GraphAnalysis:
    """Load, check and size every tensor of a model once; raises ModelError on bad input.

    Inputs must have fixed shapes (``dims``/``input_shapes`` fix dynamic ones). Then
    ``shapes="auto"`` takes sizes from static shape inference when it fixes every
    activation, and otherwise from one onnxruntime run (``probe``; random inputs of
    the right dtype, or ``input_values``); ``"run"`` always runs, ``"static"`` never.
    Without a ``probe`` a model that needs the run is a ModelError saying so.
    """
    if isinstance(src, GraphAnalysis):
        return src
    if shapes not in ("auto", "run", "static"):
        raise ModelError(f"unknown shape source {shapes!r}: use 'auto', 'run' or 'static'")
    label = _label(src)
    source: onnx.ModelProto | bytes
    values: dict[str, np.ndarray] = {}
    declared: dict[str, onnx.ValueInfoProto] = {}
    if isinstance(src, onnx.ModelProto) or dims or input_shapes or input_values:
        source = load_model(src)
        if dims or input_shapes or input_values:
            declared = _declared_types(source)
        if input_values:
            values, implied = _input_values(source, input_values, input_shapes)
            input_shapes = {**implied, **(input_shapes or {})}
        if dims:
            source = pin_dims(source, dims)
        if input_shapes:
            source = set_input_shapes(source, input_shapes)
        model_name = source.graph.name
    else:
        # Fast path for files and bytes: check and infer straight from the bytes,
        # parsing only the inferred result (a 2.4 MB model parses in milliseconds).
        source = _read(src, label)
        _check(source, label, _files_of(src))
        model_name = ""
    inferred, why_not = _infer(source, label)
    if len(inferred.graph.node) == 0:
        raise ModelError(f"{label}: invalid ONNX model: the graph has no nodes")
    g = inferred.graph
    ext_dir = _external_dir(inferred, src, label)
    model_name = model_name or g.name
    _restore_subgraphs(g, source, label)
    raw_nodes = list(g.node)
    raw_ins = [tuple(n for n in node.input if n) + tuple(_subgraph_captures(node))
               for node in raw_nodes]
    initializers = frozenset(t.name for t in g.initializer)
    inputs = tuple(vi.name for vi in g.input if vi.name not in initializers)
    _require_fixed_inputs(g, inputs, label)
    order = _toposort(raw_nodes, raw_ins, set(inputs) | initializers)
    if order != list(range(len(raw_nodes))):
        # Partitions keep this order, so store the sorted one.
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
        info = _static_info(vis[name])
        assert info is not None  # _require_fixed_inputs
        tensors[name] = info

    static: set[str] = set(initializers)
    birth: dict[str, int] = dict.fromkeys(inputs, -1)
    last_use: dict[str, int] = {}
    known = set(inputs) | initializers
    opset = next((o.version for o in inferred.opset_import if o.domain in ("", "ai.onnx")), 0)
    unsized: list[str] = []  # why static inference could not size an activation
    produced: list[str] = []
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
            info = _static_info(vis.get(o))
            if is_static:
                static.add(o)
                if info is not None:  # static values never cross cuts: size is informative
                    tensors[o] = info
                continue
            birth[o] = i
            produced.append(o)
            if info is None and node.op_type == "Dropout" and o == node.output[1]:
                info = _dropout_mask(node, o, tensors, opset)
                if info is not None:
                    tensors[o] = info
                    continue
            if info is None:
                op = node.op_type if node.domain in ("", "ai.onnx") else \
                    f"{node.domain}::{node.op_type}"
                unsized.append(_unsized(vis.get(o) or onnx.ValueInfoProto(name=o),
                                        f"output of {op} '{node.name or '?'}'"))
            else:
                tensors[o] = info
    outputs = tuple(vi.name for vi in g.output)
    n = len(nodes)
    for name in outputs:
        if name in static:
            raise ModelError(f"{label}: graph output '{name}' is a constant; unsupported")
        last_use[name] = n

    source_used = "static"
    if why_not and shapes == "static":
        given = f" with input shapes {_spec_text(input_shapes)}" if input_shapes else ""
        raise ModelError(f"{label}: shape inference failed{given}: {why_not}")
    if shapes == "run" or ((unsized or why_not) and shapes == "auto"):
        if probe is None:
            why = (unsized[0] if unsized else f"static shape inference failed ({why_not})"
                   if why_not else f"shapes={shapes!r}")
            raise ModelError(f"{label}: {why}; sizing it takes one onnxruntime run: pass "
                             f"probe=models.probe.run_shapes")
        feeds = _probe_feeds(g, inputs, values, label)
        try:
            ran = probe(inferred, feeds, produced, external_dir=ext_dir or None)
        except ModelError as exc:
            why = (f"{unsized[0]}, and the model" if unsized else
                   f"static shape inference failed ({why_not}), and the model" if why_not
                   else "the model")
            given = (" with input shapes " + _spec_text({k: v.shape for k, v in feeds.items()})
                     if feeds else "")
            guessed = [k for k, v in feeds.items() if k not in values and v.dtype.kind != "f"]
            hint = (f" (non-float inputs ran as zeros; give real data with --input-value "
                    f"{guessed[0]}=...)" if guessed else "")
            raise ModelError(f"{label}: {why} does not run in onnxruntime{given}{hint}: "
                             f"{exc}") from None
        for o in produced:
            hit = ran.get(o)
            if hit is None:
                raise ModelError(f"{label}: onnxruntime computed no value for tensor '{o}' "
                                 f"(an optional output left empty); unsupported")
            shape, dtype, nbytes = hit
            tensors[o] = TensorInfo(o, shape, dtype, nbytes)
        source_used = "run"
    elif unsized:
        raise ModelError(f"{label}: {unsized[0]}; static shape inference cannot size it "
                         f"(shapes='auto' takes it from one onnxruntime run)")
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
        shape_source=source_used,
        declared=declared or vis,
        external_dir=ext_dir,
        side_files=_files_of(src) if ext_dir else None,
    )


def dynamic_names(names: Iterable[str], ga: GraphAnalysis) -> list[str]:
    """The names that are activations (not weights or constants), in order."""
    return [n for n in names if n not in ga.static]
