"""Issue 20 finding 5: self-declared capacity decided placement.

Before: a device enrolled with a stolen token that claimed just under the caps
(``--flops 4.9e14``; the clamp stops at 5e14) got replica 0 of the next workload. The clamp's
flags were shown but never used, and a later clean birth never cleared them.

Now, on a real secure site with a real (not simulated) agent whose onnxruntime calibration
measures what it really computes: once that measurement exists placement uses it, the claim far
above it flags the device, and a flagged device holds no first (or only) replica; a clean birth
that agrees with the measurement clears the flag.
"""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

ROOT = Path(__file__).resolve().parents[2]
LIAR = "liar"
FLAG = "flops claim far above measured"


def wait_for(cond: Any, timeout: float, what: Any = None) -> Any:
    # status is a signed control request under a per-identity budget (10/s): poll gently
    return _wait_for(cond, timeout, what, interval=0.3)


def _when(st: dict[str, Any], pred: Any) -> dict[str, Any] | None:
    return st if pred(st) else None


def _workload(st: dict[str, Any], name: str) -> dict[str, Any]:
    return next(w for w in st["workloads"] if w["name"] == name)


def _row(st: dict[str, Any], did: str) -> dict[str, Any] | None:
    return next((d for d in st["devices"] if d["id"] == did), None)


def _replica0(st: dict[str, Any], name: str) -> set[str] | None:
    w = next((x for x in st["workloads"] if x["name"] == name), None)
    if w is None or not w["placement"] or any(p["phase"] != "running" for r in w["placement"]
                                              for p in r["partitions"]):
        return None
    return {p["device"] for p in w["placement"][0]["partitions"]}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSite, Path]]:
    tmp = tmp_path_factory.mktemp("claims")
    s = LocalSite(tmp / "fog", args=["--state-interval", "1", "--startup-wait", "2"]).start()
    try:
        yield s, tmp
    finally:
        s.stop()


def _liar(fog: LocalSite, tmp: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = fog.agent_argv(LIAR, tmp / LIAR, "--state-interval", "1", "--threads", "1",
                          "--labels", "role=worker,power-domain=pd-liar", *extra)
    with open(tmp / f"{LIAR}.log", "ab") as log:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)


def test_a_claim_far_above_its_measurement_gets_no_first_replica_until_a_clean_birth(
        site: tuple[LocalSite, Path]) -> None:
    fog, tmp = site
    good = [{"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pd-cam"}}] + [
        # slow honest workers: on measured figures the liar (a real CPU) is the faster device, so only
        # the rule keeps it off a first replica while its claim is flagged
        {"id": f"w{i}", "memory": 2_000_000, "flops": 1e8, "labels": {"role": "worker", "power-domain": f"pd{i}"}}
        for i in range(2)]
    group = fog.spawn_agents(good, tmp / "agents", tmp / "agents.log")
    liar = _liar(fog, tmp, "--flops", "4.9e14")  # just under the clamp's 5e14: no clamp flag
    c = fog.client()
    try:
        def status() -> dict[str, Any]:
            return c.status()  # type: ignore[no-any-return]

        wait_for(lambda: {d["id"] for d in status()["devices"] if d["alive"]} >= {"cam", "w0", "w1", LIAR}, 90,
                 "devices alive")
        assert _row(status(), LIAR)["flags"] == []  # type: ignore[index]

        # 1. no measurement yet: the claim wins the first workload; loading it measures the device
        spec = {"model": "zoo:resnet", "source": "cam", "sink": "cam", "selectors": {"role": "worker"}}
        c.deploy({"workloads": [{"name": "first", **spec}]})
        st = wait_for(lambda: _when(status(), lambda s: _replica0(s, "first")), 90,
                      lambda: f"first placed: {status()['workloads']}")
        # (unmeasured, the claim decides: the liar takes it, loads it, is measured and flagged, and
        # the replica moves, often before a status poll sees it there; its flag shows it ran it)
        # its calibration (real onnxruntime timing) is far below its claim: flagged, shown
        st = wait_for(lambda: _when(status(), lambda s: FLAG in (_row(s, LIAR) or {}).get("flags", [])), 60,
                      lambda: f"liar flagged: {_row(status(), LIAR)}")
        assert st["counters"].get("calibrations_applied", 0) >= 1
        # the first (only) replica it held moves to a verified device
        wait_for(lambda: (r := _replica0(status(), "first")) and LIAR not in r, 60, "first moved off the liar")

        # 2. the next workload: replica 0 (and the only one) is never the flagged device's
        # ("solo" may run on the liar only: while it is flagged, nothing may hold its only replica)
        solo = {**spec, "selectors": {"power-domain": "pd-liar"}}
        c.deploy({"workloads": [{"name": "next", **spec}, {"name": "pair", **spec, "replicas": 2},
                                {"name": "solo", **solo}]})
        st = wait_for(lambda: _when(status(), lambda s: _replica0(s, "next") and _replica0(s, "pair")), 90,
                      lambda: f"next placed: {status()['workloads']}")
        assert LIAR not in (_replica0(st, "next") or set())
        assert LIAR not in (_replica0(st, "pair") or set())
        assert FLAG in _row(st, LIAR)["flags"]  # type: ignore[index]
        st = wait_for(lambda: _when(status(), lambda s: "verified" in _workload(s, "solo")["reasons"]), 30,
                      lambda: f"solo pending: {_workload(status(), 'solo')}")
        assert _workload(st, "solo")["status"] == "pending"

        # 3. a clean birth (no inflated claim) that agrees with the measurement clears the flag
        _kill(liar)
        liar = _liar(fog, tmp)
        wait_for(lambda: (r := _row(status(), LIAR)) is not None and r["alive"] and r["flags"] == [], 90,
                 lambda: f"flag cleared: {_row(status(), LIAR)}")
        # verified again, it may hold a first replica: "solo" runs on it now
        wait_for(lambda: _replica0(status(), "solo") == {LIAR}, 60, lambda: f"solo: {_workload(status(), 'solo')}")
    finally:
        c.close()
        _kill(liar)
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
        group.wait(10)
