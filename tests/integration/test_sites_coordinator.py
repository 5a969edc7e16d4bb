"""`fogline coordinator --site a=... --site b=...`: real Flower rounds, two real fog sites (TLS, ACL).

Each site gets its own MQTT connection and identity (the credentials its fog issued); summaries
are stored per site and verified with that site's pinned key; every release the ServerApp writes
is rolled out canary first, then to the other site; `fogline sites status` shows both sites.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))

from cloud_coordinator.app import bundled_app
from runtime.broker import find_mosquitto

from _coordinator import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

if find_mosquitto() is None:  # pragma: no cover
    pytest.skip("mosquitto not installed", allow_module_level=True)


def test_coordinator_serves_two_sites_with_staged_releases(tmp_path: Path) -> None:
    from cloud_coordinator.sites import summaries_dir_of
    from cloud_coordinator.summaries import SiteKey, latest_summary
    from runtime.credentials import load_credentials
    from simulations.local_site import LocalSite

    sites = {n: LocalSite(tmp_path / f"fog-{n}", site=f"site-{n}", log=tmp_path / f"fog-{n}.log",
                          args=["--summary-interval", "1"]).start() for n in ("a", "b")}
    dep = Deployment(tmp_path)
    try:
        creds = {n: s.issue("cloud", role="coordinator") for n, s in sites.items()}
        coord = dep.coordinator("--app", str(bundled_app("digits")), "--rounds", "2", "--rule", "mean", "--f", "0",
                                "--min-clients", "2", "--num-partitions", "2", "--round-timeout", "60", "--grace", "1",
                                "--timeout", "240", "--no-supernode-auth", "--rollout-wait", "60",
                                "--site", f"a={creds['a']}", "--site", f"b={creds['b']}", "--canary", "b",
                                # no workload serves the releases here: the canary cannot check them
                                "--rollout-set", "allow_unchecked_canary=true")
        dep.wait_file(dep.ck / "superlink.json", 60)
        for i in range(2):
            dep.node(f"dev-{i}", None, f"partition-id={i} num-partitions=2", insecure=True)
        assert dep.wait_exit(coord, 240) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        log = (tmp_path / "coordinator.log").read_text()
        assert "rollout digits v1: done on b, a" in log and "rollout digits v2: done on b, a" in log, log[-3000:]
        for n, s in sites.items():
            c = s.client()
            try:
                rel = c.status(limit=0)["releases"]["digits"]
            finally:
                c.close()
            assert rel["version"] == 2 and rel["signer"] == "cloud"
            fog = load_credentials(creds[n]).fog
            key = SiteKey(str(summaries_dir_of(dep.ck, n)), fog.fog_id, fog.public_key.hex(), fog.site)
            summ = latest_summary(key)
            assert summ is not None and summ.site == f"site-{n}" and time.time() - summ.timestamp < 300
        settings = json.loads((dep.ck / "settings.json").read_text())
        assert sorted(settings["sites"]) == ["a", "b"] and settings["signer"] == "coordinator"
        st = dep.fogline("sites", "status", "--checkpoint-dir", str(dep.ck), "--json")
        assert st.returncode == 0, st.stderr
        doc = json.loads(st.stdout)
        assert [s["name"] for s in doc["sites"]] == ["b", "a"]
        assert all(s["releases"] == {"digits": 2} and s["summary_at"] for s in doc["sites"])
        same = dep.fogline("status", "--coordinator", str(dep.ck), "--json")  # the issue's spelling of it
        assert same.returncode == 0 and [s["name"] for s in json.loads(same.stdout)["sites"]] == ["b", "a"]
    finally:
        dep.close()
        for s in sites.values():
            s.stop()
