"""SuperNode key registration (``cloud_coordinator.registration``): what to register, retries, one-line failures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_coordinator.registration import (
    Budget,
    Outcome,
    RegistrationFailed,
    classify,
    load_ledger,
    parse_listed,
    plan,
    register_all,
    save_ledger,
)

LISTED = json.dumps({"success": True, "nodes": [{"node-id": "11", "status": "online"},
                                                {"node-id": "12", "status": "unregistered"}]})


@pytest.mark.parametrize(("ledger", "listed", "want"), [
    ({}, {}, ["a", "b", "c"]),                                         # a new SuperLink database
    ({"ka": "11", "kb": "12"}, {"11": "online", "12": "unregistered"}, ["b", "c"]),  # b was unregistered
    ({"ka": "11", "kb": "13", "kc": "11"}, {"11": "registered"}, ["b"]),  # 13 unknown to Flower
    ({"ka": "11", "kb": "", "kc": "11"}, {"11": "registered"}, ["b"]),    # "" = already known, node id unseen
    ({"ka": "11", "kb": "11", "kc": "11"}, None, ["a", "b", "c"]),       # could not ask Flower: all, idempotently
])
def test_plan_registers_only_keys_flower_does_not_list(ledger: dict[str, str], listed: dict[str, str] | None,
                                                       want: list[str]) -> None:
    assert plan({"a": "ka", "b": "kb", "c": "kc"}, ledger, listed) == want


def test_parse_listed_and_its_failures() -> None:
    assert parse_listed("Using SuperLink ...\n" + LISTED) == {"11": "online", "12": "unregistered"}
    assert parse_listed('{"success": false, "error-message": "boom"}') is None
    assert parse_listed("Traceback (most recent call last)") is None


@pytest.mark.parametrize(("rc", "out", "want"), [
    (0, '{"success": true, "node-id": "42"}', Outcome(True, node_id="42")),
    (0, '{"success": false, "error-message": "Using SuperLink: fogline (127.0.0.1:1)\\n\\n[code: 23] Public key '
        'already in use."}', Outcome(True)),
    (None, "", Outcome(False, transient=True, reason="timed out")),
    (0, '{"success": false, "error-message": "Using SuperLink: fogline (127.0.0.1:1) ConnectError: connection '
        'refused"}', Outcome(False, transient=True, reason="ConnectError: connection refused")),
    (0, '{"success": false, "error-message": "Using SuperLink: fogline (127.0.0.1:1) [code: 3] invalid key"}',
     Outcome(False, reason="[code: 3] invalid key")),
    (1, "", Outcome(False, reason="flwr exited 1")),
])
def test_classify(rc: int | None, out: str, want: Outcome) -> None:
    assert classify(rc, out) == want


def test_retries_transient_failures_with_backoff_then_succeeds() -> None:
    tries: dict[str, int] = {}
    slept: list[float] = []

    def run(dev: str, timeout_s: float) -> Outcome:
        tries[dev] = tries.get(dev, 0) + 1
        assert timeout_s == 5.0
        return Outcome(True, node_id=f"n-{dev}") if tries[dev] == 3 else Outcome(False, transient=True, reason="x")

    got = register_all(["a"], run, Budget(try_s=5.0, attempts=3, backoff_s=0.5, workers=2), sleep=slept.append)
    assert got == {"a": "n-a"} and tries == {"a": 3} and slept == [0.5, 1.0]


def test_a_permanent_failure_is_one_line_naming_the_device_without_retries() -> None:
    tries: list[str] = []

    def run(dev: str, timeout_s: float) -> Outcome:
        tries.append(dev)
        return Outcome(True) if dev == "ok" else Outcome(False, reason=f"[code: 3] bad key of {dev}")

    with pytest.raises(RegistrationFailed) as err:
        register_all(["ok", "pi-2", "pi-1"], run, Budget(workers=2), sleep=lambda s: None)
    assert str(err.value) == ("could not register the SuperNode key of pi-1 with the SuperLink: "
                              "[code: 3] bad key of pi-1 (and 1 more)")
    assert sorted(tries) == ["ok", "pi-1", "pi-2"]  # tried once each


def test_bounded_concurrency_and_budget() -> None:
    import threading

    live, peak, lock = [0], [0], threading.Lock()
    gate = threading.Event()

    def run(dev: str, timeout_s: float) -> Outcome:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        gate.wait(0.05)
        with lock:
            live[0] -= 1
        return Outcome(True, node_id=dev)

    assert len(register_all([f"d{i}" for i in range(12)], run, Budget(workers=3))) == 12
    assert peak[0] <= 3
    b = Budget(try_s=10.0, attempts=3, backoff_s=1.0, workers=4)
    assert b.total_s(4) == 33.0 and b.total_s(5) == 66.0


def test_ledger_round_trip(tmp_path: Path) -> None:
    save_ledger(tmp_path / "l.json", {"kb": "2", "ka": ""})
    assert load_ledger(tmp_path / "l.json") == {"ka": "", "kb": "2"}
    (tmp_path / "bad.json").write_text("[")
    assert load_ledger(tmp_path / "bad.json") == {} and load_ledger(tmp_path / "none.json") == {}


@pytest.mark.integration
def test_superlink_entry_refuses_a_missing_fleet_address() -> None:
    r = subprocess.run([sys.executable, "-m", "cloud_coordinator.superlink", "--host", "127.0.0.1"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --fleet-address HOST:PORT is required (got '')"]


def test_fleet_filter_passes_only_fleet_routes() -> None:
    import asyncio

    from cloud_coordinator.superlink import fleet_only, fleet_paths

    paths = fleet_paths()
    assert "/v1/fleet/pull-messages" in paths and not any(p.startswith("/v1/control") for p in paths)
    seen: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        seen.append(scope["path"])

    sent: list[dict] = []  # type: ignore[type-arg]

    async def send(msg: dict) -> None:  # type: ignore[type-arg]
        sent.append(msg)

    f = fleet_only(app, paths)  # type: ignore[arg-type]
    for method, path in (("POST", "/v1/fleet/pull-messages"), ("POST", "/v1/control/start-run"),
                         ("POST", "/v1/runtime/acquire-task"), ("GET", "/v1/fleet/pull-messages"),
                         ("POST", "/v1/fleet/../control/list-runs"), ("GET", "/docs")):
        asyncio.run(f({"type": "http", "method": method, "path": path, "root_path": ""}, None, send))
    assert seen == ["/v1/fleet/pull-messages"]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [404] * 5
