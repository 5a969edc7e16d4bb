"""`fogline demo` end to end: two sites and one coordinator, real processes, faults, a staged rollout, a report,
and nothing left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from simulations.demo import Budgets, DemoConfig

# The demo bounds each of its waits by the work it waits for (simulations.demo.Budgets) and fails
# with the step and its reason when one runs out or a child dies; this bound, their sum, only
# catches a demo that hangs outside a wait. It is long so that a loaded machine still passes.
# Two rounds hold every item of the federated step: a kill -9 of the coordinator after round 1, the
# resume, and round 2's release staged canary first (a third round only repeated round 2, ~30 s).
CFG = DemoConfig(out=Path(), agents=14, requests=60, rounds=2)
BUDGET_S = Budgets.of(CFG).total(CFG)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(BUDGET_S + 120)]


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
                               "--requests", str(CFG.requests), "--rounds", str(CFG.rounds), "--agents",
                               str(CFG.agents)], capture_output=True, text=True, timeout=BUDGET_S, env=env)
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
    assert report["incomplete"] is False and report["status"] == "done"
    assert [s["name"] for s in report["steps"]] == ["sites", "agents", "deploy", "serve", "re-place", "federated",
                                                    "rollout"]
    assert all(s["status"] == "done" for s in report["steps"]), report["steps"]
    c = report["counters"]
    per_site = CFG.requests  # --requests is per site
    assert c["requests_sent"] == 2 * per_site and c["requests_answered"] == 2 * per_site
    assert c["requests_lost"] == 0 and c["requests_failed"] == 0 and c["outputs_mismatched"] == 0
    assert c["rounds_completed"] == CFG.rounds and c["rounds_repeated"] <= 1
    assert c["faults_injected"] == 2 and c["recoveries"] == 2
    assert report["release"]["agreement"] == 1.0
    # 3 partitions x 2 replicas at the canary, replicas on different power domains
    assert [len(r["partitions"]) for r in report["placement"]] == [3, 3]
    labels = {d["id"]: d["labels"].get("power-domain") for d in report["devices"] if d["site"] == "store-1"}
    domains = [{labels[p["device"]] for p in r["partitions"]} for r in report["placement"]]
    assert not domains[0] & domains[1]

    # two sites, each with its own fog and its own devices, all of them live but the one killed
    sites = report["sites"]
    assert list(sites) == ["store-1", "store-2"]
    assert sites["store-1"]["role"] == "canary" and sites["store-2"]["role"] == "#1"
    assert sites["store-1"]["mqtt"] != sites["store-2"]["mqtt"]
    assert sites["store-1"]["fog_id"] != sites["store-2"]["fog_id"]
    cas = {n: v["ca_sha256"] for n, v in report["security"]["sites"].items()}
    assert len(set(cas.values())) == 2 and None not in cas.values()
    members = {d["id"]: d["site"] for d in report["devices"]}
    assert len(members) == CFG.agents
    killed = {f["target"]: f["site"] for f in report["faults"] if f["kind"] == "kill -9 device"}
    assert list(killed.values()) == ["store-1"]
    for name, s in sites.items():
        assert len(s["devices"]) >= 6 and sorted(s["devices"]) == sorted(d for d, n in members.items() if n == name)
        assert s["devices_total"] == len(s["devices"])
        assert s["devices_live"] == len(s["devices"]) - sum(n == name for n in killed.values()), (name, s)
        # requests served at both sites: the resnet stream and the released CNN
        assert s["requests"]["sent"] == per_site and s["requests"]["answered"] == per_site, (name, s["requests"])
        assert s["requests"]["failed"] == 0 and s["requests"]["mismatched"] == 0
        assert s["release"]["checked"] == 50 and s["release"]["agreement"] == 1.0, (name, s["release"])
        assert s["release"]["signer"] == "cloud"       # re-signed with the identity that site's fog issued
        assert s["fog_requests_answered"] >= per_site + 50
        assert s["trainers"]                            # SuperNodes on devices of both sites
    assert {f["site"] for f in report["faults"]} == {"store-1", "cloud"}

    # the final release reached the canary first, was checked there, then reached store-2
    ro = report["rollout"]
    final = ro["final_version"]
    assert final == CFG.rounds and ro["canary"] == "store-1"
    assert ro["canary_first"] and ro["canary_checked"], ro
    t = ro["final"]
    assert t["store-1"]["accepted_s"] < t["store-2"]["accepted_s"], t
    assert t["store-1"]["serving_s"] is not None and t["store-2"]["serving_s"] is not None, t
    last = next(r for r in ro["book"] if r["version"] == final)
    assert last["step"] == "done" and last["canary"] == "store-1" and last["order"] == ["store-2"]
    assert {n: st["state"] for n, st in last["sites"].items()} == {"store-1": "accepted", "store-2": "accepted"}
    assert any(ch.startswith("held-out batch: 8/8 answered, outputs equal") for ch in last["checks"]), last
    assert all(s["release"]["release_version"] == final for s in sites.values())
    for png in ("placement.png", "latency.png", "accuracy.png", "sites.png"):
        assert (out / png).stat().st_size > 1000
    assert elapsed < BUDGET_S, f"demo took {elapsed:.0f} s"
    time.sleep(0.5)
    left = _children_of(out)
    assert not left, f"processes left behind: {[p.pid for p in left]}"
