"""The formats in the repository: docs/formats.md names every field the parser reads, and the
examples under examples/ are accepted as they are by ``fogline place`` and by the parser
``fogline deploy`` runs before it connects."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fog_broker.placement import model as placement_model
from runtime import cliargs
from runtime.cli import main

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = sorted((REPO / "examples" / "workloads").glob("*.json"))
FLEETS = sorted((REPO / "examples" / "fleets").glob("*.json"))
DOC = REPO / "docs" / "formats.md"


def _fleet_of(workloads: Path) -> Path:
    """``examples/workloads/NAME-*.json`` runs on ``examples/fleets/NAME.json``."""
    return REPO / "examples" / "fleets" / f"{workloads.stem.split('-')[0]}.json"


def test_examples_exist() -> None:
    assert len(WORKLOADS) >= 3 and len(FLEETS) >= 2
    assert {_fleet_of(w) for w in WORKLOADS} == set(FLEETS)  # every fleet has a workload file


@pytest.mark.parametrize("path", WORKLOADS, ids=[p.name for p in WORKLOADS])
def test_deploy_accepts_workload_example(path: Path) -> None:
    from fog_broker.service_cli import read_deploy

    body = read_deploy(cliargs.json_file(str(path)))
    assert body["workloads"] and all(isinstance(w["model"], str) for w in body["workloads"])


@pytest.mark.parametrize("path", WORKLOADS, ids=[p.name for p in WORKLOADS])
def test_place_places_every_example(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = _fleet_of(path)
    assert main(["place", "--fleet", str(fleet), "--workloads", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) == {"workloads", "evicted", "metrics"}
    assert set(plan["metrics"]) == {"utilization", "fragmentation", "solve_s"}
    pending = {r["name"]: r.get("reasons") for r in plan["workloads"] if r["status"] != "placed"}
    assert not pending, pending  # an example shows a plan, not a refusal
    for r in plan["workloads"]:
        for rep in r["replicas"]:
            assert set(rep) == {"partitions", "latency_s", "energy_j"}
            assert all(set(p) == {"segments", "device"} for p in rep["partitions"])


def test_every_parsed_field_is_documented() -> None:
    """A field added to the placement's data classes without a line in docs/formats.md fails here."""
    text = DOC.read_text()
    json_names = {"segment_times": "segment_times_s"}
    missing = []
    for cls in (placement_model.Device, placement_model.Battery, placement_model.Taint,
                placement_model.Toleration, placement_model.Workload, placement_model.ChainProfile,
                placement_model.Segment, placement_model.Quota):
        for f in dataclasses.fields(cls):
            if f.init and not f.name.startswith("_") and f.name != "index":
                name = json_names.get(f.name, f.name)
                if f"`{name}`" not in text and f"`{name}," not in text and f" {name}}}" not in text \
                        and f"{{{name}," not in text and f".{name}`" not in text:
                    missing.append(f"{cls.__name__}.{name}")
    assert not missing, missing


def test_no_pointer_to_files_outside_the_repository(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in (["deploy", "--help"], ["place", "--help"], ["models", "profile", "--help"]):
        assert main(cmd) == 0
        out = capsys.readouterr().out
        assert "COST_MODEL" not in out and "docs/formats.md" in out, out
    assert "COST_MODEL" not in (REPO / "README.md").read_text()
    assert "COST_MODEL" not in DOC.read_text()


_CAM = {"name": "cam", "model": "zoo:mlp", "source": "a", "sink": "a"}


@pytest.mark.parametrize("extra, says", [
    ({"replica": 2}, "workload cam: unknown field 'replica'; did you mean 'replicas'?"),
    ({"slo": 1.0}, "unknown field 'slo'; did you mean 'slo_s'?"),
    ({"autoscaling": {"min_replicas": 1, "max_replicas": 2}}, "did you mean 'autoscale'?"),
    ({"colour": "blue"}, "unknown field 'colour' (known: "),
    ({"slo_s": 0}, "slo_s: must be > 0, got 0"),
    ({"slo_s": "1s"}, "slo_s: expected a finite number, got '1s'"),
    ({"rate_fps": -3}, "rate_fps: must be > 0"),
    ({"replicas": 2, "autoscale": {"min_replicas": 1, "max_replicas": 2}}, "either 'replicas' or 'autoscale'"),
    ({"autoscale": {"min_replicas": 3, "max_replicas": 1}}, "autoscale.max_replicas: must be >= min_replicas (3)"),
    ({"autoscale": {"min_replicas": 0, "max_replicas": 1}}, "autoscale.min_replicas: must be >= 1"),
    ({"autoscale": {"min_replicas": 1, "max_replicas": 2, "target_utilization": 1.5}},
     "target_utilization: must be in (0, 1]"),
    ({"autoscale": {"min_replicas": 1, "max_replica": 2}}, "did you mean 'max_replicas'?"),
])
def test_deploy_refuses_bad_serving_fields_in_one_line_before_connecting(
        extra: dict[str, object], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps({**_CAM, **extra}))
    # no broker is running: the file is refused before any connection, exit 2, nothing deployed
    assert main(["deploy", str(path), "--broker", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_serving_fields_are_kept_and_round_trip() -> None:
    w = placement_model.Workload.from_dict({**_CAM, "slo_s": 0.5, "rate_fps": 12,
                                            "autoscale": {"min_replicas": 2, "max_replicas": 4}})
    assert (w.slo_s, w.rate_fps, w.replicas) == (0.5, 12.0, 2)
    assert w.autoscale == placement_model.Autoscale(2, 4, 0.7)
    assert placement_model.Workload.from_dict(w.to_dict()) == w
