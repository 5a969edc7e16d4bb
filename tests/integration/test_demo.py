"""`fogline demo` end to end: real processes, faults, a report, and nothing left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]


def _children_of(out: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(out) in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_demo_serves_trains_survives_faults_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "runtime.cli", "demo", "--json", "--out", str(out),
                               "--requests", "60", "--rounds", "3"],
                              capture_output=True, text=True, timeout=420, env=env)
    except BaseException:
        for p in _children_of(out):  # a demo killed mid-run cannot clean up: its children must not
            try:                     # outlive the test (a stale fog would answer the next one's mDNS)
                p.kill()
            except psutil.NoSuchProcess:
                pass
        raise
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads(proc.stdout)
    c = report["counters"]
    assert c["requests_sent"] == 60 and c["requests_answered"] == 60
    assert c["requests_lost"] == 0 and c["requests_failed"] == 0 and c["outputs_mismatched"] == 0
    assert c["rounds_completed"] == 3 and c["rounds_repeated"] <= 1
    assert c["faults_injected"] == 2 and c["recoveries"] == 2
    assert report["release"]["agreement"] == 1.0
    # 3 partitions x 2 replicas, replicas on different power domains
    assert [len(r["partitions"]) for r in report["placement"]] == [3, 3]
    labels = {d["id"]: d["labels"].get("power-domain") for d in report["devices"]}
    domains = [{labels[p["device"]] for p in r["partitions"]} for r in report["placement"]]
    assert not domains[0] & domains[1]
    for png in ("placement.png", "latency.png", "accuracy.png"):
        assert (out / png).stat().st_size > 1000
    assert elapsed < 420, f"demo took {elapsed:.0f} s"
    time.sleep(0.5)
    left = _children_of(out)
    assert not left, f"processes left behind: {[p.pid for p in left]}"
