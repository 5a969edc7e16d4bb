"""The Open Inference Protocol core (``fog_broker.oip``): parsing, checking, encoding; no sockets."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fog_broker import oip
from fog_broker.oip import InferRequest, ModelSpec, OutputRequest, ProtocolError

ROOT = Path(__file__).resolve().parents[2]
SPEC = ModelSpec.from_io("m", "3", {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}, {"name": "ids", "dtype": "int64", "shape": [-1]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": [1, 2]}, {"name": "z", "dtype": "int64", "shape": [-1]}]})


def _req(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _x(data: Any = None, **kw: Any) -> dict[str, Any]:
    return {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4] if data is None else data, **kw}


IDS = {"name": "ids", "shape": [2], "datatype": "INT64", "data": [7, 8]}


@pytest.mark.parametrize("numpy_name, kserve", [
    ("float32", "FP32"), ("float64", "FP64"), ("float16", "FP16"), ("int64", "INT64"), ("int32", "INT32"),
    ("int8", "INT8"), ("uint8", "UINT8"), ("uint64", "UINT64"), ("bool", "BOOL"), ("str", "BYTES")])
def test_datatype_names(numpy_name: str, kserve: str) -> None:
    assert oip.datatype_of(numpy_name) == kserve


def test_metadata_with_fixed_input_shapes() -> None:
    spec = ModelSpec.from_io("m", "1", {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 4]}],
                                        "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 2]}]},
                             {"x": (1, 4)})
    assert spec.metadata() == {"name": "m", "versions": ["1"], "platform": "onnxruntime_onnx",
                               "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4]}],
                               "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]}


def test_json_request_flat_and_nested_data() -> None:
    for data in ([1, 2, 3, 4], [[1, 2, 3, 4]]):
        r = oip.parse_infer(_req([_x(data), IDS], id="r-1", outputs=[{"name": "y"}]))
        assert r.id == "r-1" and r.outputs == (OutputRequest("y"),) and not r.binary_output
        assert r.inputs["x"].dtype == np.float32 and r.inputs["x"].tolist() == [[1, 2, 3, 4]]
        assert r.inputs["ids"].dtype == np.int64
        oip.check_inputs(r, SPEC)


def test_binary_request_round_trip() -> None:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    ids = np.array([5, -6], dtype=np.int64)
    head = _req([{"name": "x", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
                 {"name": "ids", "shape": [2], "datatype": "INT64", "parameters": {"binary_data_size": 16}}],
                parameters={"binary_data_output": True, "timeout": 250_000},
                outputs=[{"name": "z", "parameters": {"binary_data": False}}, {"name": "y"}])
    r = oip.parse_infer(head + x.tobytes() + ids.tobytes(), len(head))
    np.testing.assert_array_equal(r.inputs["x"], x)
    np.testing.assert_array_equal(r.inputs["ids"], ids)
    assert r.binary_output and r.timeout_s == pytest.approx(0.25)
    oip.check_inputs(r, SPEC)
    body, hl = oip.encode_response("m", "3", r, {"y": np.array([[0.5, 1.5]], np.float32), "z": np.array([9])},
                                   ["y", "z"], {"replica": 1})
    assert hl is not None
    doc = json.loads(body[:hl])
    assert doc["model_name"] == "m" and doc["model_version"] == "3" and doc["parameters"] == {"replica": 1}
    z, y = doc["outputs"]  # in the order requested
    assert z == {"name": "z", "datatype": "INT64", "shape": [1], "data": [9]}
    assert y["parameters"] == {"binary_data_size": 8} and "data" not in y
    np.testing.assert_array_equal(np.frombuffer(body[hl:], "<f4"), [0.5, 1.5])


def test_json_response_all_outputs_in_model_order_and_id_only_when_given() -> None:
    r = InferRequest(None, {})
    body, hl = oip.encode_response("m", "3", r, {"z": np.array([1, 2]), "y": np.zeros((1, 2), np.float32)},
                                   ["y", "z"])
    doc = json.loads(body)
    assert hl is None and "id" not in doc and [o["name"] for o in doc["outputs"]] == ["y", "z"]


@pytest.mark.parametrize("body, header_length, status, words", [
    (b"[1, 2]", None, 400, "must be a JSON object"),
    (b"{\"inputs\": [", None, 400, "not valid JSON"),
    (_req([]), None, 400, "non-empty list"),
    (_req([_x(), _x()]), None, 400, "given twice"),
    (_req([_x(["a", "b", "c", "d"])]), None, 400, "not numbers"),
    (_req([_x([1, 2, 3])]), None, 400, "needs 4"),
    (_req([_x([[1, 2], [3]])]), None, 400, "data"),
    (_req([_x(datatype="BYTES")]), None, 400, "BYTES tensors are not supported"),
    (_req([_x(datatype="FLOAT")]), None, 400, "is not one of"),
    (_req([_x(shape=[1, -4])]), None, 400, "non-negative"),
    (_req([_x(shape=[1 << 20, 1 << 20])]), None, 413, "more than"),
    (_req([{**IDS, "data": [1.5, 2]}]), None, 400, "not integers"),
    (_req([{**IDS, "datatype": "UINT8", "data": [1, 300]}]), None, 400, "outside the range"),
    (_req([{**IDS, "datatype": "BOOL", "data": [1, 0]}]), None, 400, "true/false"),
    (_req([{"name": "x", "shape": [1, 4], "datatype": "FP32"}]), None, 400, "neither 'data' nor"),
    (_req([{"name": "x", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 12}}]), None, 400,
     "does not match"),
    (_req([{"name": "x", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}]), None, 400,
     "holds 0 bytes"),
    (_req([_x()]) + b"xx", len(_req([_x()])), 400, "no input claims"),
    (_req([_x()]), 10_000, 400, "outside the body"),
    (_req([_x()], id=5), None, 400, "'id' must be a string"),
    (_req([_x()], parameters={"timeout": -1}), None, 400, "microseconds"),
    (_req([_x()], parameters={"binary_data_output": "yes"}), None, 400, "must be a boolean"),
    (_req([_x()], parameters={"nested": {"a": 1}}), None, 400, "string, number or boolean"),
    (_req([_x()], outputs=[{"name": "y", "parameters": {"classification": 3}}]), None, 400, "classification"),
    (_req([_x()]).replace(b"3, 4]", b"3, 1e999]", 1), None, 400, "non-finite"),  # 1e999 parses as inf
    (_req([_x([1, 2, 3, float("nan")])]), None, 400, "non-finite"),      # the NaN literal Python allows
    (_req([_x([1, 2, 3, 1e39])]), None, 400, "non-finite"),               # finite, but inf as FP32
    (_req([{"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}])
     + np.array([np.inf], "<f4").tobytes(), len(_req([{"name": "x", "shape": [1], "datatype": "FP32",
                                                      "parameters": {"binary_data_size": 4}}])), 400, "non-finite"),
])
def test_malformed_requests_are_protocol_errors(body: bytes, header_length: int | None, status: int,
                                                words: str) -> None:
    with pytest.raises(ProtocolError) as e:
        oip.parse_infer(body, header_length)
    assert e.value.status == status and words in e.value.message


@pytest.mark.parametrize("inputs, outputs, words", [
    ([_x(), IDS, {"name": "w", "shape": [1], "datatype": "FP32", "data": [1]}], [], "unexpected input 'w'"),
    ([_x()], [], "missing input 'ids'"),
    ([_x(datatype="FP64"), IDS], [], "datatype FP64; model 'm' expects FP32"),
    ([{**_x(), "shape": [4]}, IDS], [], "shape [4]; model 'm' expects [1, 4]"),
    ([{**_x(), "shape": [2, 2]}, IDS], [], "shape [2, 2]"),
    ([_x(), {**IDS, "shape": [1, 2]}], [], "expects [-1]"),
    ([_x(), IDS], [{"name": "q"}], "unknown output 'q'"),
])
def test_requests_checked_against_the_model(inputs: list[dict[str, Any]], outputs: list[dict[str, Any]],
                                            words: str) -> None:
    r = oip.parse_infer(_req(inputs, outputs=outputs))
    with pytest.raises(ProtocolError) as e:
        oip.check_inputs(r, SPEC)
    assert e.value.status == 400 and words in e.value.message, e.value.message


def test_tensors_larger_than_an_activation_are_413() -> None:
    spec = ModelSpec.from_io("big", "1", {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1]}], "outputs": []})
    x = np.zeros(1000, np.float32)
    head = _req([{"name": "x", "shape": [1000], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}])
    r = oip.parse_infer(head + x.tobytes(), len(head))
    oip.check_inputs(r, spec, 4000)
    with pytest.raises(ProtocolError) as e:
        oip.check_inputs(r, spec, 3999)
    assert e.value.status == 413 and "4000 bytes" in e.value.message


def test_error_body_is_one_line_json() -> None:
    assert json.loads(oip.error_body("two\nlines   here")) == {"error": "two lines here"}


@pytest.mark.parametrize("failure, status", [
    ("unknown", 404), ("not ready", 503), ("overloaded", 503), ("timeout", 504), ("failed", 500),
])
def test_router_failure_kinds_map_to_protocol_statuses(failure: str, status: int) -> None:
    from fog_broker.http_api import _result_error
    from runtime.messages import InferenceResult
    assert _result_error("w", InferenceResult("r", False, {}, "why", failure=failure)).status == status


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.one_of(st.none(), st.integers(-5, 500)))
def test_fuzz_any_bytes_give_a_request_or_a_protocol_error(body: bytes, header_length: int | None) -> None:
    try:
        oip.parse_infer(body, header_length)
    except ProtocolError as exc:
        assert 400 <= exc.status < 500


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["FP32", "FP64", "INT64", "INT32", "UINT8", "BOOL", "FP16"]),
       st.lists(st.integers(0, 4), min_size=0, max_size=3), st.booleans(), st.integers(0, 2**32 - 1))
def test_round_trip_any_tensor(datatype: str, shape: list[int], binary: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dt = np.dtype(oip.DATATYPES[datatype]).newbyteorder("=")
    arr = (rng.random(shape) * 100).astype(dt) if dt.kind != "b" else rng.random(shape) > 0.5
    out = oip.InferRequest(None, {}, (OutputRequest("t", binary),))
    body, hl = oip.encode_response("m", "1", out, {"t": arr})
    doc = json.loads(body[:hl] if hl else body)
    t = doc["outputs"][0]
    assert t["datatype"] == datatype and t["shape"] == shape
    if binary:
        t["parameters"] = {"binary_data_size": len(body) - hl}
        req = oip.parse_infer(json.dumps({"inputs": [t]}).encode() + body[hl:], len(json.dumps({"inputs": [t]})))
    else:
        req = oip.parse_infer(json.dumps({"inputs": [t]}).encode())
    np.testing.assert_array_equal(req.inputs["t"], arr)
    assert req.inputs["t"].dtype == dt


@pytest.mark.parametrize("outputs, binary_output, want", [
    ((), False, 40 + 8),                                     # every output as JSON numbers
    ((), True, 0),                                           # every output binary: one copy each
    ((oip.OutputRequest("a"),), False, 40),                  # only what was asked for
    ((oip.OutputRequest("a", binary=True), oip.OutputRequest("b")), False, 8),
    ((oip.OutputRequest("a", binary=False),), True, 40),     # per-output flag over the request's
])
def test_json_bytes_counts_only_outputs_written_as_json(outputs: tuple[oip.OutputRequest, ...],
                                                        binary_output: bool, want: int) -> None:
    req = oip.InferRequest(None, {}, outputs, binary_output)
    tensors = {"a": np.zeros(10, np.float32), "b": np.zeros(2, np.float32)}
    assert oip.json_bytes(req, tensors) == want


@pytest.mark.parametrize("binary", [False, True])
def test_a_non_finite_output_is_an_error_not_invalid_json(binary: bool) -> None:
    out = oip.InferRequest(None, {}, (OutputRequest("t", binary),))
    arr = np.array([1.0, np.nan, np.inf], dtype=np.float32)
    if binary:  # raw bytes carry NaN as IEEE does: valid as sent
        body, hl = oip.encode_response("m", "1", out, {"t": arr})
        assert hl is not None and json.loads(body[:hl])["outputs"][0]["parameters"]["binary_data_size"] == 12
        return
    with pytest.raises(ProtocolError) as e:
        oip.encode_response("m", "1", out, {"t": arr})
    assert e.value.status == 500 and "non-finite" in e.value.message and "\n" not in e.value.message
