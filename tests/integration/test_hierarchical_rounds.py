"""Two-level rounds on real Flower: a cloud SuperLink whose SuperNodes are sites, each site a SuperLink of devices.

Three sites (``fogline site-aggregator``) with three or four device SuperNodes, all
authenticated with Flower's SuperNode keys over TLS, the digits app:

* site-a has a device that sends NaN updates: the site rejects it by reason,
  and the cloud's round report says so under site-a;
* site-b has a sign-flipping device: the site's trimmed mean outvotes it;
* site-c is a Byzantine site (its bridge flips the sign of its aggregate):
  the cloud's rule (median over sites) outvotes it;
* site-b's whole aggregator is killed with -9 after round 1 and restarted:
  the run finishes with site-b and all its devices back.

The model still learns (central accuracy). The sites reach the cloud only
through a ``WanLink`` relay that counts bytes (the WAN); the bytes it saw are printed (with a
model this small, Flower's polling, heartbeats and the app's FAB dominate;
``fogline bench hierarchy`` compares the update bytes of flat and two-level
rounds).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))

from cloud_coordinator.app import bundled_app
from runtime.broker import free_port
from simulations.wan_relay import WanLink

from _coordinator import VENV_BIN, Deployment, kill_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]
SITES = ("site-a", "site-b", "site-c")
DEVICES = {"site-a": 4, "site-b": 3, "site-c": 3}  # site-a: 3 usable besides its NaN device (trimmed mean, f=1)
ROUNDS = 2  # round 1, the kill -9 of site-b, round 2 with site-b and its devices back: every item, no repeat


def _site(dep: Deployment, site: str, cloud_port: int, procs: list[subprocess.Popen[bytes]],
          bridge_attack: str = "") -> int:
    """The site's device keys, authorized at the site, and its aggregator started (not waited for)."""
    work = dep.root / site
    keys = dep.root / "site-keys" / site
    for i in range(DEVICES[site]):
        dev = f"{site}-dev-{i}"
        assert dep.fogline("supernodes", "keygen", "--out", str(keys / dev)).returncode == 0
        assert dep.fogline("supernodes", "add", dev, str(keys / dev / "supernode.pub"), "--checkpoint-dir",
                           str(work)).returncode == 0
    port = free_port()
    _aggregator(dep, site, port, cloud_port, procs, bridge_attack, wait=False)
    return port


def _devices(dep: Deployment, site: str, port: int, first: int, attacks: dict[int, str],
             procs: list[subprocess.Popen[bytes]]) -> None:
    """The site's device SuperNodes, once its SuperLink has registered their keys."""
    work = dep.root / site
    keys = dep.root / "site-keys" / site
    dep.wait_file(work / "superlink.json", 120)
    n = sum(DEVICES.values())
    for i in range(DEVICES[site]):
        dev = f"{site}-dev-{i}"
        attack = f" byzantine='{attacks[i]}'" if i in attacks else ""
        cmd = [str(VENV_BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
               "--root-certificates", str(work / "superlink-tls" / "ca.pem"),
               "--auth-supernode-private-key", str(keys / dev / "supernode.key"),
               "--node-config", f"partition-id={first + i} num-partitions={n}{attack}"]
        with open(dep.root / f"{dev}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env={**dep.env, "FLWR_HOME": str(dep.root / f"home-{dev}")},
                                          start_new_session=True))


def _aggregator(dep: Deployment, site: str, port: int, cloud_port: int, procs: list[subprocess.Popen[bytes]],
                bridge_attack: str = "", *, wait: bool = True) -> subprocess.Popen[bytes]:
    work = dep.root / site
    ready = work / "superlink.json"
    ready.unlink(missing_ok=True)
    argv = [str(VENV_BIN / "fogline"), "-v", "site-aggregator", "--app", str(bundled_app("digits")),
            "--work-dir", str(work), "--site", site, "--listen", f"127.0.0.1:{port}", "--rule", "trimmed_mean",
            "--f", "1", "--round-timeout", "45", "--grace", "2", "--cloud", f"127.0.0.1:{cloud_port}",
            "--cloud-ca", str(dep.ck / "superlink-tls" / "ca.pem"), "--cloud-key", str(dep.keys[site])]
    if bridge_attack:
        argv += ["--cloud-node-config", f"byzantine='{bridge_attack}'"]
    with open(dep.root / f"{site}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dep.env, start_new_session=True)
    procs.append(proc)
    if wait:
        dep.wait_file(ready, 120)
    return proc


def test_two_level_round_with_a_byzantine_device_and_a_byzantine_site(tmp_path: Path) -> None:
    dep = Deployment(tmp_path)
    proxy = WanLink(dep.port)  # never cut here: it counts what crosses the WAN
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for s in SITES:
            dep.authorize(s)  # the cloud authorizes each site's SuperNode key, under the site's name
        n = sum(DEVICES.values())
        coord = dep.coordinator("--app", str(bundled_app("digits")), "--hierarchical", "--rounds", str(ROUNDS),
                                "--rule", "median", "--f", "1", "--num-partitions", str(n),
                                "--round-timeout", "60", "--grace", "2", "--timeout", "400", "--seed", "7",
                                "--local-epochs", "3", "--site-bridge", "simulations.faulty_bridge:app")  # site-c lies
        dep.wait_file(dep.ck / "superlink.json", 60)
        attacks = {"site-a": {2: "nan"}, "site-b": {0: "sign-flip"}, "site-c": {}}
        ports = {s: _site(dep, s, proxy.port, procs, "sign-flip" if s == "site-c" else "") for s in SITES}
        first = 0
        for s in SITES:  # the three sites start side by side; devices join each once its SuperLink is ready
            _devices(dep, s, ports[s], first, attacks[s], procs)
            first += DEVICES[s]
        # kill -9 of a whole site aggregator (SuperLink, site server, cloud SuperNode) after round 1, and a restart
        # the way systemd restarts it: the cloud retries, the site's devices reconnect, nothing else changes
        dep.wait_file(dep.ck / "ckpt-00000001.json", 300)
        victim = next(p for p in procs if "site-aggregator" in p.args and "site-b" in p.args)  # type: ignore[operator]
        kill_tree(victim)
        procs.remove(victim)
        _aggregator(dep, "site-b", ports["site-b"], proxy.port, procs)
        code = dep.wait_exit(coord, 400)
        assert code == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        rep = json.loads((dep.ck / "report.json").read_text())
        hist = rep["history"]
        assert [h["round"] for h in hist] == list(range(1, ROUNDS + 1))
        for h in hist:
            assert h["clients"] == list(SITES), h  # the cloud's clients are the sites, by authenticated key
            sites = h["sites"]
            assert set(sites) == set(SITES)
            # site-a: its NaN device never in the site's aggregate (rejected, or too late for a retried round)
            assert sites["site-a"]["site-clients"] == DEVICES["site-a"]
            assert sites["site-a"]["site-accepted"] <= DEVICES["site-a"] - 1
            assert sites["site-b"]["site-clients"] == DEVICES["site-b"]
        # ... and rejected by its reason at the site, reported to the cloud
        assert any(h["sites"]["site-a"].get("site-rejected-non-finite-values") == 1 for h in hist), hist
        assert hist[-1]["sites"]["site-b"]["site-clients"] == DEVICES["site-b"]  # back, with all its devices
        acc = hist[-1]["server"]["accuracy"]
        assert acc > 0.8, hist  # a sign-flipping device, a NaN device and a sign-flipping site: still learns
        # Every byte between the sites and the cloud went through the proxy (the WAN); per-device traffic never did.
        assert proxy.up > 0 and proxy.down > 0
        per_round = (proxy.up + proxy.down) / ROUNDS
        print(f"\nWAN bytes per round {per_round:.0f} (up {proxy.up}, down {proxy.down}); accuracy {acc:.3f}; "
              f"round s {[round(x, 1) for x in rep['round_s']]}")
    finally:
        for p in procs:
            kill_tree(p)
        dep.close()
        proxy.close()
