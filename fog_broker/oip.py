"""The Open Inference Protocol (KServe v2, REST) as values: pure parsing, checking and encoding.

No sockets, no clock: ``fog_broker.http_api`` (the aiohttp adapter) hands this
module request bytes and gets back named numpy arrays, or a ``ProtocolError``
carrying the HTTP status and the one-line message of the protocol's error
body (``{"error": "..."}``). ``fog_broker.infer_inputs`` reads the same JSON
tensor format from files for ``fogline infer``.

Covered: the inference request and response objects (JSON tensor data, flat or
nested), the binary tensor data extension (``binary_data_size``,
``binary_data``, ``binary_data_output``, ``Inference-Header-Content-Length``),
request ids, request ``parameters`` (Triton's ``timeout`` in microseconds is
honoured, and ``stream``: answers of one stream in the order sent; others are
ignored) and ``outputs`` selection; model metadata from a
model's input/output description with KServe datatype names. ``BYTES`` tensors
are refused: no Fogline partition takes strings.
"""
from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.errors import RemoteViolation

__all__ = [
    "DATATYPES", "EXTENSIONS", "ProtocolError", "TensorSpec", "ModelSpec", "OutputRequest", "InferRequest",
    "datatype_of", "parse_infer", "parse_tensors", "check_inputs", "encode_response", "error_body",
    "MAX_ELEMENTS", "ENCODINGS", "inflate", "json_bytes",
]

# KServe datatype -> numpy dtype (little-endian, as the binary extension sends them).
DATATYPES: Mapping[str, str] = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "int8", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}
_BY_NUMPY: Mapping[str, str] = {np.dtype(v).name: k for k, v in DATATYPES.items()}
EXTENSIONS = ("binary_tensor_data",)
MAX_ELEMENTS = 1 << 26        # per tensor: far above anything an MQTT activation can carry
_MAX_RANK = 16
_MAX_TIMEOUT_S = 120.0


class ProtocolError(RemoteViolation):
    """A request the protocol refuses: ``status`` is the HTTP code, the message the error body's."""

    def __init__(self, status: int, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after  # a 503's Retry-After (whole seconds)


def datatype_of(numpy_name: str) -> str:
    """KServe datatype name of a numpy dtype name (``float32`` -> ``FP32``); ``BYTES`` for strings."""
    name = np.dtype(numpy_name).name if numpy_name not in ("unknown", "") else numpy_name
    if name in _BY_NUMPY:
        return _BY_NUMPY[name]
    if name.startswith(("str", "bytes", "object")):
        return "BYTES"
    return name.upper()


def error_body(message: str) -> bytes:
    """The protocol's error object: ``{"error": "..."}`` (one line)."""
    return json.dumps({"error": " ".join(str(message).split())}).encode()


# ------------------------------------------------------------------ request bodies

ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")
_INFLATE_STEP = 1 << 20


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """A request body under its ``Content-Encoding``, inflated a step at a time and never past ``limit``
    bytes (``ProtocolError(413)`` when it would be more: a bomb costs at most ``limit``); a body that
    is not what it says it is: ``ProtocolError(400)``. ``deflate`` is zlib-wrapped or raw, as sent."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        if len(data) > limit:
            raise ProtocolError(413, f"request body larger than {limit} bytes")
        return data
    if enc not in ENCODINGS:
        raise ProtocolError(415, f"Content-Encoding {encoding[:40]!r} is not supported: send gzip, deflate "
                                 "or an uncompressed body")
    if enc == "deflate":
        wbits = zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        wbits = 16 + zlib.MAX_WBITS
    out = bytearray()
    rest = data
    try:
        while rest:
            d = zlib.decompressobj(wbits)
            while not d.eof:
                chunk = d.decompress(rest, min(_INFLATE_STEP, limit + 1 - len(out)))
                out += chunk
                if len(out) > limit:
                    raise ProtocolError(413, f"request body larger than {limit} bytes once inflated "
                                             f"(Content-Encoding: {enc})")
                if not chunk and len(d.unconsumed_tail) == len(rest):
                    break  # no progress: the input ran out before the stream's end
                rest = d.unconsumed_tail
            if not d.eof:
                raise ProtocolError(400, f"the body ends inside its {enc} stream (truncated)")
            rest = d.unused_data
            if wbits != 16 + zlib.MAX_WBITS and rest:  # only gzip has members one after another
                raise ProtocolError(400, f"{len(rest)} bytes follow the end of the {enc} stream")
    except zlib.error as exc:
        raise ProtocolError(400, f"the body is not valid {enc} data (Content-Encoding: {enc}): {exc}") from None
    return bytes(out)


# ------------------------------------------------------------------ model metadata


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output: KServe datatype and shape (-1: any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def accepts(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(w < 0 or w == g for w, g in zip(self.shape, shape))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What ``GET /v2/models/{name}`` answers, and what an inference request is checked against."""

    name: str
    version: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    platform: str = "onnxruntime_onnx"

    @classmethod
    def from_io(cls, name: str, version: str, io: Mapping[str, Any],
                input_shapes: Mapping[str, Sequence[int]] | None = None) -> ModelSpec:
        """From ``ArtifactBuilder.io_spec`` rows (numpy dtype names); a workload's ``input_shapes``
        (the shapes its partitions were built for) replace the graph's shapes of those inputs."""
        fixed = dict(input_shapes or {})

        def rows(items: Any, use_fixed: bool) -> tuple[TensorSpec, ...]:
            out = []
            for r in items:
                shape = fixed.get(r["name"]) if use_fixed else None
                out.append(TensorSpec(str(r["name"]), datatype_of(str(r["dtype"])),
                                      tuple(int(d) for d in (shape if shape is not None else r["shape"]))))
            return tuple(out)
        return cls(name, version, rows(io.get("inputs", ()), True), rows(io.get("outputs", ()), False))

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": [self.version], "platform": self.platform,
                "inputs": [t.to_json() for t in self.inputs], "outputs": [t.to_json() for t in self.outputs]}

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)


# ------------------------------------------------------------------ inference requests


@dataclass(frozen=True, slots=True)
class OutputRequest:
    name: str
    binary: bool | None = None    # None: the request's binary_data_output decides


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A parsed inference request: tensors by name, what to return and how."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: tuple[OutputRequest, ...] = ()   # empty: every output of the model
    binary_output: bool = False
    parameters: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None

    def wants_binary(self, out: OutputRequest) -> bool:
        return self.binary_output if out.binary is None else out.binary


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProtocolError(400, f"{where} must be a JSON object")
    return v


def _params(v: Any, where: str) -> dict[str, Any]:
    if v is None:
        return {}
    d = _obj(v, where)
    for k, x in d.items():
        if not isinstance(x, (str, int, float, bool)):
            raise ProtocolError(400, f"{where}.{k} must be a string, number or boolean")
    return d


def _flag(params: Mapping[str, Any], key: str, where: str) -> bool | None:
    v = params.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ProtocolError(400, f"{where}.{key} must be a boolean")
    return v


def _shape(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > _MAX_RANK:
        raise ProtocolError(400, f"{where}.shape must be a list of at most {_MAX_RANK} dimensions")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        raise ProtocolError(400, f"{where}.shape must hold non-negative integers")
    if math.prod(v) > MAX_ELEMENTS:
        raise ProtocolError(413, f"{where} has more than {MAX_ELEMENTS} elements")
    return tuple(v)


def _dtype(v: Any, where: str) -> np.dtype[Any]:
    if v == "BYTES":
        raise ProtocolError(400, f"{where}: BYTES tensors are not supported (no Fogline model takes strings)")
    if not isinstance(v, str) or v not in DATATYPES:
        raise ProtocolError(400, f"{where}.datatype {str(v)[:20]!r} is not one of {', '.join(DATATYPES)}")
    return np.dtype(DATATYPES[v])


def _from_json(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    if not isinstance(data, list):
        raise ProtocolError(400, f"{where}.data must be a JSON array (flat or nested, row-major)")
    try:
        if dtype.kind == "b":
            arr = np.asarray(data, dtype=object)
            if not all(isinstance(x, bool) for x in arr.ravel().tolist()):
                raise ValueError("BOOL data must be true/false")
            arr = arr.astype(bool)
        else:
            arr = np.asarray(data)
            if arr.size == 0:  # [] (or [[]]) parses as float64: no element says anything about the type
                arr = arr.astype(dtype.newbyteorder("="))
            if arr.dtype.kind not in "iufb" or (dtype.kind in "iu" and arr.dtype.kind == "f"):
                raise ValueError(f"elements are not {'integers' if dtype.kind in 'iu' else 'numbers'}")
            if dtype.kind in "iu" and arr.size:
                info = np.iinfo(dtype)
                if arr.min() < info.min or arr.max() > info.max:
                    raise ValueError(f"values outside the range of {dtype.name}")
            arr = arr.astype(dtype.newbyteorder("="), copy=False)
    except (ValueError, TypeError, OverflowError) as exc:
        msg = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise ProtocolError(400, f"{where}.data: {msg}") from None
    if arr.size != math.prod(shape):
        raise ProtocolError(400, f"{where}.data has {arr.size} elements; shape {list(shape)} needs "
                                 f"{math.prod(shape)}")
    return arr.reshape(shape)


def parse_tensors(items: Any, binary: memoryview | bytes = b"", where: str = "inputs") -> dict[str, np.ndarray]:
    """The ``inputs`` list of an inference request -> name -> array; ``binary`` feeds the
    tensors that carry a ``binary_data_size`` parameter, in order, and must be used up exactly."""
    if not isinstance(items, list) or not items:
        raise ProtocolError(400, f"'{where}' must be a non-empty list of tensors")
    view = memoryview(binary)
    offset = 0
    out: dict[str, np.ndarray] = {}
    for i, raw in enumerate(items):
        w = f"{where}[{i}]"
        t = _obj(raw, w)
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise ProtocolError(400, f"{w}.name must be a non-empty string")
        w = f"{where}[{i}] ({name!r})"
        if name in out:
            raise ProtocolError(400, f"input {name!r} is given twice")
        shape = _shape(t.get("shape"), w)
        dtype = _dtype(t.get("datatype"), w)
        params = _params(t.get("parameters"), f"{w}.parameters")
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ProtocolError(400, f"{w}.parameters.binary_data_size must be a non-negative integer")
            if "data" in t:
                raise ProtocolError(400, f"{w} has both 'data' and binary_data_size")
            need = math.prod(shape) * dtype.itemsize
            if size != need:
                raise ProtocolError(400, f"{w}: binary_data_size {size} does not match shape {list(shape)} "
                                         f"of {t['datatype']} ({need} bytes)")
            if offset + size > len(view):
                raise ProtocolError(400, f"{w}: the body holds {len(view) - offset} bytes of binary data, "
                                         f"not {size}")
            arr = np.frombuffer(view[offset:offset + size], dtype=dtype).reshape(shape)
            if dtype.byteorder == "<" and not np.little_endian:  # pragma: no cover - big-endian hosts
                arr = arr.astype(dtype.newbyteorder("="))
            offset += size
        else:
            if "data" not in t:
                raise ProtocolError(400, f"{w} has neither 'data' nor parameters.binary_data_size")
            arr = _from_json(t["data"], dtype, shape, w)
        if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():  # 1e999 parses as inf
            raise ProtocolError(400, f"{w} holds a non-finite value (inf or NaN): inputs must be finite")
        out[name] = arr
    if offset != len(view):
        raise ProtocolError(400, f"{len(view) - offset} bytes of binary data follow the JSON that no "
                                 "input claims (binary_data_size)")
    return out


def parse_infer(body: bytes, header_length: int | None = None) -> InferRequest:
    """An inference request body; ``header_length`` is ``Inference-Header-Content-Length`` (or None)."""
    if header_length is None:
        header_length = len(body)
    elif not 0 < header_length <= len(body):
        raise ProtocolError(400, f"Inference-Header-Content-Length {header_length} is outside the body "
                                 f"({len(body)} bytes)")
    try:
        doc = json.loads(bytes(memoryview(body)[:header_length]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(400, f"the request is not valid JSON ({str(exc).splitlines()[0][:100]})") from None
    except RecursionError:  # the C scanner's depth guard: JSON nested thousands deep
        raise ProtocolError(400, "the request is not valid JSON (nested too deeply)") from None
    doc = _obj(doc, "the inference request")
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(400, "'id' must be a string")
    params = _params(doc.get("parameters"), "parameters")
    inputs = parse_tensors(doc.get("inputs"), memoryview(body)[header_length:])
    outs: list[OutputRequest] = []
    raw_outs = doc.get("outputs")
    if raw_outs is not None:
        if not isinstance(raw_outs, list):
            raise ProtocolError(400, "'outputs' must be a list")
        for i, o in enumerate(raw_outs):
            o = _obj(o, f"outputs[{i}]")
            name = o.get("name")
            if not isinstance(name, str) or not name:
                raise ProtocolError(400, f"outputs[{i}].name must be a non-empty string")
            op = _params(o.get("parameters"), f"outputs[{i}].parameters")
            if "classification" in op:
                raise ProtocolError(400, f"outputs[{i}]: the classification extension is not supported")
            outs.append(OutputRequest(name, _flag(op, "binary_data", f"outputs[{i}].parameters")))
    timeout = params.get("timeout")  # Triton's request parameter, in microseconds
    timeout_s = None
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ProtocolError(400, "parameters.timeout must be a positive number of microseconds")
        timeout_s = min(float(timeout) / 1e6, _MAX_TIMEOUT_S)
    return InferRequest(rid, inputs, tuple(outs), bool(_flag(params, "binary_data_output", "parameters")),
                        params, timeout_s)


def check_inputs(req: InferRequest, spec: ModelSpec, max_bytes: int | None = None) -> None:
    """The request's tensors against the model: every input present, known, of its datatype and shape;
    every requested output known; ``ProtocolError(400)`` naming the first problem. More than
    ``max_bytes`` of tensors (what one activation can carry): ``ProtocolError(413)``."""
    want = {t.name for t in spec.inputs}
    for name, arr in req.inputs.items():
        t = spec.input(name)
        if t is None:
            raise ProtocolError(400, f"unexpected input {name!r}: model {spec.name!r} takes "
                                     f"{', '.join(sorted(want)) or 'no inputs'}")
        got = datatype_of(arr.dtype.name)
        if got != t.datatype:
            raise ProtocolError(400, f"input {name!r} has datatype {got}; model {spec.name!r} expects {t.datatype}")
        if not t.accepts(arr.shape):
            raise ProtocolError(400, f"input {name!r} has shape {list(arr.shape)}; model {spec.name!r} "
                                     f"expects {list(t.shape)}")
    missing = sorted(want - set(req.inputs))
    if missing:
        raise ProtocolError(400, f"missing input {missing[0]!r} of model {spec.name!r}")
    size = sum(a.nbytes for a in req.inputs.values())
    if max_bytes is not None and size > max_bytes:
        raise ProtocolError(413, f"inputs of {size} bytes exceed the {max_bytes} bytes an activation may carry "
                                 "to a device")
    outs = {t.name for t in spec.outputs}
    for o in req.outputs:
        if outs and o.name not in outs:
            raise ProtocolError(400, f"unknown output {o.name!r}: model {spec.name!r} has "
                                     f"{', '.join(sorted(outs))}")


# ------------------------------------------------------------------ responses


def json_bytes(req: InferRequest, tensors: Mapping[str, Any]) -> int:
    """Bytes of the outputs ``encode_response`` writes as JSON numbers, the costly part (a binary
    output is one copy)."""
    binary = {o.name: req.wants_binary(o) for o in req.outputs}
    names = list(binary) if req.outputs else list(tensors)
    return sum(int(getattr(tensors[n], "nbytes", 0)) for n in names
               if n in tensors and not binary.get(n, req.binary_output))


def encode_response(model: str, version: str, req: InferRequest, tensors: Mapping[str, np.ndarray],
                    order: Sequence[str] = (), parameters: Mapping[str, Any] | None = None
                    ) -> tuple[bytes, int | None]:
    """The inference response: (body, JSON header length if binary tensors follow it, else None).

    Outputs in the order requested, else in ``order`` (the model's), else as produced.
    """
    if req.outputs:
        chosen = list(req.outputs)
    else:
        names = [n for n in order if n in tensors] + [n for n in tensors if n not in order]
        chosen = [OutputRequest(n) for n in names]
    doc: dict[str, Any] = {"model_name": model, "model_version": version}
    if req.id is not None:
        doc["id"] = req.id
    if parameters:
        doc["parameters"] = dict(parameters)
    outputs = []
    blobs: list[bytes] = []
    for o in chosen:
        if o.name not in tensors:
            raise ProtocolError(500, f"the model produced no output {o.name!r}")
        arr = np.asarray(tensors[o.name])
        row: dict[str, Any] = {"name": o.name, "datatype": datatype_of(arr.dtype.name), "shape": list(arr.shape)}
        if req.wants_binary(o):
            dt = DATATYPES.get(row["datatype"])
            data = np.ascontiguousarray(arr, dtype=np.dtype(dt) if dt else arr.dtype).tobytes()
            row["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:
            if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
                # NaN and Infinity are not JSON: say so rather than answer what no client parses
                raise ProtocolError(500, f"the model produced a non-finite value (inf or NaN) in output "
                                         f"{o.name!r}")
            row["data"] = arr.ravel().tolist()
        outputs.append(row)
    doc["outputs"] = outputs
    try:
        head = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:  # a non-finite number in the parameters
        raise ProtocolError(500, "the response holds a non-finite number (not JSON)") from None
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
