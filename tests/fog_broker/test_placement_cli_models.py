"""``fogline place`` with ONNX models: input shapes (flag and JSON), measured segment times,
and predicted vs measured compute latency from a real onnxruntime run of the chain."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="place --measure runs the partitions in onnxruntime")
onnx = pytest.importorskip("onnx", reason="ONNX models are built with onnx.helper")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from runtime.cli import main  # noqa: E402

HOST = {"id": "host", "flops": 2e9, "memory_bytes": 1e9, "uplink_bps": 1e9,
        "downlink_bps": 1e9, "rtt_s": 1e-4, "labels": {"device-class": "this-host"}}
EDGE = {**HOST, "id": "edge", "flops": 5e8, "labels": {"device-class": "pi4"},
        "providers": ["CPUExecutionProvider"]}


def _mlp(path: Path) -> Path:
    """Input [N, ?]: a named and an anonymous dim, so --input-shape is needed."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"W{i}")
             for i in range(4)]
    nodes, x = [], "x"
    for i in range(4):
        nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"h{i}"]),
                  helper.make_node("Tanh", [f"h{i}"], [f"t{i}"])]
        x = f"t{i}"
    g = helper.make_graph(nodes, "mlp4", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", None])], [helper.make_tensor_value_info(
            "t3", TensorProto.FLOAT, ["N", 64])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.write_bytes(m.SerializeToString())
    return path


def _files(tmp_path: Path, **extra: object) -> tuple[str, str]:
    _mlp(tmp_path / "mlp.onnx")
    fleet, wl = tmp_path / "fleet.json", tmp_path / "wl.json"
    fleet.write_text(json.dumps({"devices": [HOST, EDGE]}))
    wl.write_text(json.dumps({"workloads": [{"name": "mlp", "model": "mlp.onnx",
                                             "source": "host", "sink": "host", **extra}]}))
    return str(fleet), str(wl)


def _place(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["place", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_missing_input_shape_is_one_line(tmp_path: Path, capsys) -> None:
    fleet, wl = _files(tmp_path)
    code, _, err = _place(["--fleet", fleet, "--workloads", wl], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "workload mlp" in lines[0] and "--input-shape x=" in lines[0]


@pytest.mark.parametrize("how", ["flag", "json"])
def test_input_shape_from_flag_or_json(tmp_path: Path, capsys, how: str) -> None:
    extra = {"input_shapes": {"x": [8, 64]}} if how == "json" else {}
    fleet, wl = _files(tmp_path, **extra)
    argv = ["--fleet", fleet, "--workloads", wl, "--json"]
    if how == "flag":
        argv += ["--input-shape", "x=8,64"]
    code, out, err = _place(argv, capsys)
    assert code == 0, err
    (res,) = json.loads(out)["workloads"]
    assert res["status"] == "placed"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--input-shape", "x=8,65"], "does not run in onnxruntime with input shapes x=8,65"),
    (["--input-shape", "x=8"], "does not match the model"),
    (["--input-shape", "y=8,64"], "no 'model' workload"),
    (["--input-shape", "x8,64"], "--input-shape expects"),
])
def test_bad_shapes_exit_2(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    fleet, wl = _files(tmp_path)
    code, _, err = _place(["--fleet", fleet, "--workloads", wl, *argv], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


def test_measure_reports_predicted_vs_measured(tmp_path: Path, capsys) -> None:
    """Segment times measured here (bench-segments) make the prediction match the run."""
    fleet, wl = _files(tmp_path)
    model = str(tmp_path / "mlp.onnx")
    assert main(["models", "bench-segments", model, "--input-shape", "x=8,64", "--json",
                 "--device-class", "this-host", "--repeats", "5"]) == 0
    bench = json.loads(capsys.readouterr().out)
    assert len(bench["seconds"]) == len(bench["segments"]) == len(bench["calibrated_s"])
    times = bench["segment_times_s"]
    doc = json.loads(Path(wl).read_text())
    doc["workloads"][0].update(input_shapes={"x": [8, 64]}, segment_times_s=times)
    Path(wl).write_text(json.dumps(doc))
    code, out, err = _place(["--fleet", fleet, "--workloads", wl, "--json", "--measure",
                             "--repeats", "5"], capsys)
    assert code == 0, err
    d = json.loads(out)
    row = d["latency_check"]["workloads"]["mlp"]
    # Measured times on 'this-host' (2 GFLOP/s on paper) keep the chain there.
    assert {p["device"] for p in row["partitions"]} == {"host"}
    assert row["predicted_compute_s"] == pytest.approx(sum(times["this-host"]), rel=1e-9)
    assert row["measured_compute_s"] > 0 and d["latency_check"]["median_abs_error"] >= 0
    assert d["workloads"][0]["replicas"][0]["latency_s"] == pytest.approx(
        row["predicted_latency_s"])
    code, out, _ = _place(["--fleet", fleet, "--workloads", wl, "--measure", "--repeats", "3"],
                          capsys)
    assert code == 0 and "predicted vs measured compute" in out and "mlp: predicted" in out


def test_segment_times_of_the_wrong_length(tmp_path: Path, capsys) -> None:
    fleet, wl = _files(tmp_path, input_shapes={"x": [1, 64]},
                       segment_times_s={"pi4": [0.1, 0.2, 0.3]})
    code, _, err = _place(["--fleet", fleet, "--workloads", wl], capsys)
    assert code == 2 and "segment_times_s.pi4 has 3 times" in err and len(
        err.strip().splitlines()) == 1
