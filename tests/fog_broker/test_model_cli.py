"""JSON formats of COST_MODEL.md, clear errors on bad input, the CLI (purity: tests/test_purity.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fog_broker.placement import Fleet, SpecError, Workload, parse_workloads, schedule
from runtime.errors import FoglineError

DEV = {"id": "pi-07", "labels": {"power-domain": "a"}, "taints": [], "flops": 2e9,
       "memory_bytes": 4e6, "uplink_bps": 1e7, "downlink_bps": 1e7, "rtt_s": 0.002,
       "power_active_w": 5.0, "power_idle_w": 1.0, "tx_j_per_byte": 1e-7, "rx_j_per_byte": 1e-7,
       "cpu_count": 1,
       "battery": {"capacity_wh": 10.0, "level": 0.5}, "alive": True}
PROF = {"model": "m", "input_bytes": 3072, "segments": [
    {"name": f"s{i}", "flops": 1e8, "param_bytes": 1e5, "activation_bytes": 5e4,
     "out_bytes": 1e4} for i in range(4)]}
WL = {"name": "cam", "tenant": "a", "priority": 1, "replicas": 1, "objective": "latency",
      "source": "pi-07", "sink": "pi-07", "selectors": {}, "tolerations": [],
      "max_partitions": 2, "profile": PROF}


def test_round_trip() -> None:
    fleet = Fleet.from_dict({"devices": [DEV]})
    assert Fleet.from_dict(fleet.to_dict()) == fleet
    assert fleet.to_dict()["devices"][0] == DEV
    w = Workload.from_dict(WL)
    assert Workload.from_dict(w.to_dict()) == w


def test_plan_json_shape() -> None:
    fleet = Fleet.from_dict({"devices": [DEV]})
    ws, _ = parse_workloads({"workloads": [WL, {**WL, "name": "big", "selectors": {"z": "q"}}]})
    d = schedule(fleet, ws).to_dict()
    assert set(d) == {"workloads", "evicted", "metrics"}
    assert set(d["metrics"]) == {"utilization", "fragmentation", "solve_s"}
    placed, pending = d["workloads"]
    assert set(placed) == {"name", "status", "replicas"}
    rep = placed["replicas"][0]
    assert set(rep) == {"partitions", "latency_s", "energy_j"}
    assert rep["partitions"] == [{"segments": [0, 3], "device": "pi-07"}]
    assert set(pending) == {"name", "status", "reasons"} and pending["status"] == "pending"
    json.dumps(d)


@pytest.mark.parametrize("doc,needle", [
    ({"devices": [{**DEV, "flops": "fast"}]}, "flops"),
    ({"devices": [{k: v for k, v in DEV.items() if k != "memory_bytes"}]}, "memory_bytes"),
    ({"devices": [DEV, DEV]}, "duplicate"),
    ({"devices": {}}, "list"),
    ({}, "devices"),
])
def test_bad_fleet(doc: object, needle: str) -> None:
    with pytest.raises(SpecError, match=needle) as ei:
        Fleet.from_dict(doc)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, FoglineError)


@pytest.mark.parametrize("doc,needle", [
    ({"workloads": [{**WL, "objective": "speed"}]}, "objective"),
    ({"workloads": [{k: v for k, v in WL.items() if k != "profile"}]}, "model"),
    ({"workloads": [{**WL, "model": "x.onnx"}]}, "exactly one"),
    ({"workloads": [{**WL, "replicas": 0}]}, "replicas"),
    ({"workloads": [WL, WL]}, "duplicate"),
    ({"workloads": [WL], "quotas": {"a": {}}}, "memory_bytes"),
])
def test_bad_workloads(doc: object, needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        parse_workloads(doc)


def _files(tmp_path: Path, wl: object) -> tuple[str, str]:
    f, w = tmp_path / "fleet.json", tmp_path / "wl.json"
    f.write_text(json.dumps({"devices": [DEV]}))
    w.write_text(json.dumps(wl))
    return str(f), str(w)


def test_cli_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.cli import main

    f, w = _files(tmp_path, {"workloads": [WL, {**WL, "name": "x", "selectors": {"z": "q"}}]})
    assert main(["place", "--fleet", f, "--workloads", w, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workloads"][0]["status"] == "placed" and out["metrics"]["solve_s"] > 0
    assert main(["place", "--fleet", f, "--workloads", w]) == 0
    text = capsys.readouterr().out
    assert "NAME" in text and "pending" in text and "x: selector:" in text


def test_cli_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.cli import main

    f, w = _files(tmp_path, {"workloads": [{"name": "x"}]})
    assert main(["place", "--fleet", f, "--workloads", w]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert main(["place", "--fleet", str(tmp_path / "none.json"), "--workloads", w]) == 2
