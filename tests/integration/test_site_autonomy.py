"""Site autonomy (issue 13): cut the coordinator's WAN link to a site; the site goes on alone; news drains after.

Real parts: ``fogline broker`` (its own mosquitto, TLS, ACL), enrolled agents in their own processes,
and the coordinator's ``SiteService`` (the sites half of ``fogline coordinator``) in this process, its
one connection to the site going through ``WanLink`` (``simulations.wan_relay``): a TCP relay that
the test cuts like a WAN (no byte moves either way, nothing is closed: no FIN, no RST, so both ends
find out by their keepalives) and heals (the connections of the cut are gone, as a NAT or a rebooted
router would leave them).
The agents, the fog and the test's operators talk to the site's mosquitto directly: only the
coordinator's link is cut.

During the cut the site answers every inference (in-process client and ``fogline infer``), re-places
the partitions of an agent killed with -9, takes a new deploy from its local operator, and keeps
publishing its fleet summary; ``fogline sites status`` says the site is cut off, in one line. A
release the coordinator queues during the cut waits for the link (its rollout clock stands still:
the cut lasts longer than the rollout's timeouts) and, once the link is back, reaches the site, is
acknowledged and lands in ``releases/published.json``; the coordinator stores the summary the site
published after the kill.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.broker import find_mosquitto
from simulations.wan_relay import WanLink

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

if find_mosquitto() is None:  # pragma: no cover - make test installs it
    pytest.skip("mosquitto not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
ONE = {"model": "zoo:mlp", "source": "cam", "sink": "cam", "max_partitions": 1}   # one partition, one host
SHORT_TIMEOUTS = {"baseline_timeout_s": 6.0, "accept_timeout_s": 6.0, "site_timeout_s": 6.0}  # the cut is longer


class Site:
    """One fog site with four agents: cam (source/sink) and s0 (serves svc) share a process; w0 and w1
    (where vic runs: kill -9 targets) each have their own."""

    def __init__(self, tmp: Path) -> None:
        from simulations.local_site import LocalSite

        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.fog = LocalSite(tmp / "fog", site="store-1", log=tmp / "fog.log",
                             args=["--state-interval", "1", "--startup-wait", "2", "--summary-interval", "1"])
        self.fog.start()
        base = [{"id": "cam", "memory": 50_000_000, "flops": 1e9, "labels": {"role": "source", "power-domain": "pc"}},
                {"id": "s0", "memory": 50_000_000, "flops": 5e9, "labels": {"role": "serve", "power-domain": "p0"}}]
        self.procs["base"] = self.fog.spawn_agents(base, tmp / "agents", tmp / "agents-base.log")
        for i in range(2):
            w = {"id": f"w{i}", "memory": 50_000_000, "flops": 5e9,
                 "labels": {"role": "worker", "power-domain": f"pw{i}"}}
            self.procs[f"w{i}"] = self.fog.spawn_agents([w], tmp / "agents", tmp / f"agents-w{i}.log")

    def kill9(self, name: str) -> None:
        p = self.procs[name]
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.wait(10)

    def close(self) -> None:
        for name in self.procs:
            self.kill9(name)
        self.fog.kill()


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    try:
        yield s
    finally:
        s.close()


def _workload(st: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((w for w in st["workloads"] if w["name"] == name), None)


def _hosts(w: dict[str, Any]) -> set[str]:
    return {p["device"] for r in w["placement"] for p in r["partitions"]}


def _fogline(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "runtime.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, check=False)


class Load:
    """Closed-loop inference on svc from an operator's own connection to the site: every outcome counted."""

    def __init__(self, client: Any, x: np.ndarray, want: np.ndarray) -> None:
        self.client, self.x, self.want = client, x, want
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="svc-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = self.client.infer("svc", {"x": self.x}, timeout=5)
                np.testing.assert_allclose(out["logits"], self.want, rtol=1e-4, atol=1e-5)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - counted, asserted on
                self.failures.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def test_site_serves_places_and_repairs_while_cut_off_and_news_drains_after(site: Site, tmp_path: Path) -> None:
    from cloud_coordinator.release import build_release, read_release, write_release
    from cloud_coordinator.rollout import RolloutPolicy
    from cloud_coordinator.settings import RELEASES_DIR, key_path
    from cloud_coordinator.sites import SiteSpec, resolve, save_table, summaries_dir_of
    from cloud_coordinator.siteservice import SiteService
    from cloud_coordinator.summaries import SiteKey, latest_summary
    from models import zoo
    from runtime.credentials import load_credentials
    from runtime.security import Identity

    t_start = time.monotonic()
    fog = site.fog
    cloud = fog.issue("cloud", role="coordinator")
    ops = fog.issue("ops")                       # `fogline infer` runs as its own identity
    admin = fog.client()
    load: Load | None = None
    service: SiteService | None = None
    wan = WanLink(fog.port)
    ck = tmp_path / "ck"
    try:
        wait_for(lambda: sum(d["alive"] for d in admin.status()["devices"]) >= 4, 60,
                 "four agents alive", interval=0.2, retry_on=Exception)
        admin.deploy({"workloads": [
            {**ONE, "name": "svc", "selectors": {"role": "serve"}},
            {**ONE, "name": "vic", "selectors": {"role": "worker"}}]})
        admin.wait_running("svc", 60)
        vic_hosts = _hosts(admin.wait_running("vic", 60))
        assert vic_hosts <= {"w0", "w1"} and len(vic_hosts) == 1, vic_hosts
        victim = vic_hosts.pop()

        import onnxruntime as ort
        mlp = zoo.build("mlp").SerializeToString()
        x = np.random.default_rng(3).random((1, 64), dtype=np.float32)
        want = ort.InferenceSession(mlp, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.save(tmp_path / "x.npy", x)

        # the coordinator, its link to the site through the WAN relay
        table = resolve([SiteSpec("a", str(cloud), f"127.0.0.1:{wan.port}")],
                        # okm v1 is a first release nothing serves yet: the canary cannot check it
                        policy=RolloutPolicy.from_mapping({**SHORT_TIMEOUTS, "allow_unchecked_canary": True}))
        save_table(ck, table)
        signer = Identity.load_or_create("coordinator", key_path(ck, "coordinator.key"))
        service = SiteService(ck, table, signer, poll_s=1.0, fast_poll_s=0.5).start()
        fogk = load_credentials(cloud).fog
        key = SiteKey(str(summaries_dir_of(ck, "a")), fogk.fog_id, fogk.public_key.hex(), fogk.site)

        def status_row() -> dict[str, Any]:
            r = _fogline("sites", "status", "--checkpoint-dir", str(ck), "--json")
            assert r.returncode == 0, r.stderr
            doc = json.loads(r.stdout)
            assert doc["coordinator_running"], doc
            return dict(doc["sites"][0])

        wait_for(lambda: status_row()["reachable"] is True, 30, "the coordinator to reach the site",
                 interval=0.2, retry_on=Exception)
        wait_for(lambda: latest_summary(key) is not None, 20, "a first summary at the coordinator",
                 interval=0.2, retry_on=Exception)

        load = Load(admin, x, want).start()
        wait_for(lambda: load.ok >= 3, 20, "svc answering", interval=0.2, retry_on=Exception)

        # ------------------------------------------------------------------ the cut
        wan.cut()
        t_cut, wall_cut = time.monotonic(), time.time()
        # the coordinator queues a release during the cut (what its ServerApp does after a round)
        write_release(ck / RELEASES_DIR, build_release(mlp, signer, "okm", 1, {"source": "during the cut"}))
        print(f"\nsetup {t_cut - t_start:.1f} s; link cut")

        cli_ok = 0
        for _ in range(3):
            r = _fogline("infer", "svc", str(tmp_path / "x.npy"), "--credentials", str(ops), "--json")
            assert r.returncode == 0, r.stderr[-2000:]
            np.testing.assert_allclose(json.loads(r.stdout)["outputs"]["logits"], want, rtol=1e-4, atol=1e-5)
            cli_ok += 1

        # kill -9 the agent that hosts vic: the fog re-places it alone
        site.kill9(victim)
        t_kill = time.monotonic()
        other = ({"w0", "w1"} - {victim}).pop()
        def replaced() -> bool:
            w = _workload(admin.status(), "vic")
            return bool(w and w["healthy_replicas"] >= 1 and _hosts(w) == {other})

        wait_for(replaced, 30, f"vic re-placed from {victim} to {other}", interval=0.2,
                 retry_on=Exception)
        print(f"vic re-placed from {victim} to {other} in {time.monotonic() - t_kill:.1f} s, still cut off")
        assert admin.infer("vic", {"x": x}, timeout=5)["logits"].shape == want.shape

        # a new deploy through the site's own operator
        admin.deploy({**ONE, "name": "fresh", "selectors": {"role": "serve"}})
        admin.wait_running("fresh", 30)
        np.testing.assert_allclose(admin.infer("fresh", {"x": x}, timeout=5)["logits"], want, rtol=1e-4, atol=1e-5)

        # the coordinator says so, in one line, once its connection is known to be gone (keepalive)
        def shown_cut_off() -> bool:
            row = status_row()
            return row["reachable"] is False and "no MQTT connection" in (row["error"] or "")

        wait_for(shown_cut_off, 45, "the site shown cut off", interval=0.2, retry_on=Exception)
        shown = _fogline("sites", "status", "--checkpoint-dir", str(ck)).stdout
        lines = [ln for ln in shown.splitlines() if ln.startswith("  a: ")]
        print(shown)
        assert len(lines) == 1 and lines[0].startswith("  a: cut off: no MQTT connection to 127.0.0.1:"), shown
        assert "the site runs on its own" in lines[0]
        assert any(ln.split()[:4] == ["a", "canary", f"127.0.0.1:{wan.port}", "NO"] for ln in shown.splitlines())

        # nothing reached the coordinator during the cut, and the release waits (longer than its timeouts)
        wait_for(lambda: time.monotonic() - t_cut > 2 * SHORT_TIMEOUTS["baseline_timeout_s"], 30,
                 "a long cut", interval=0.2, retry_on=Exception)
        summ = latest_summary(key)
        assert summ is not None and summ.timestamp < wall_cut + 1.0, "a summary crossed the cut link"
        book = json.loads((ck / "rollouts.json").read_text())
        okm = [r for r in book["rollouts"] if r["name"] == "okm"]
        assert [r["step"] for r in okm] == ["baseline"], okm   # waiting for the link, not failed
        assert admin.status(limit=0).get("releases", {}).get("okm") is None
        cut_s = time.monotonic() - t_cut

        # ------------------------------------------------------------------ the link returns
        wan.heal()
        t_heal, wall_heal = time.monotonic(), time.time()
        wait_for(lambda: status_row()["reachable"] is True, 30, "the site reachable again",
                 interval=0.2, retry_on=Exception)
        t_back = time.monotonic()
        def summary_after_heal() -> Any:
            s = latest_summary(key)
            return s if s is not None and s.timestamp > wall_heal else None

        fresh = wait_for(summary_after_heal, 20, "a summary from after the cut", interval=0.2,
                         retry_on=Exception)
        alive = {d.device_id: d.alive for d in fresh.devices}
        assert alive.get(victim) is False and alive.get(other) is True, alive   # the kill, as the site saw it
        assert service.drain(30), service.snapshot()
        okm = [r for r in service.snapshot()["rollouts"] if r["name"] == "okm"]
        assert [r["step"] for r in okm] == ["done"] and okm[0]["sites"]["a"]["state"] == "accepted", okm
        rel = admin.status(limit=0)["releases"]["okm"]
        v1 = read_release(ck / RELEASES_DIR / "okm-v000000001.release")
        assert rel["version"] == 1 and rel["signer"] == "cloud" and rel["model"] == f"file:{v1.sha256}", rel
        published = json.loads((ck / RELEASES_DIR / "published.json").read_text())
        assert published["okm-v000000001.release"]["sites"] == ["a"], published
        wait_for(lambda: status_row()["releases"] == {"okm": 1}, 10,
                 "the release listed by `fogline sites status`", interval=0.2, retry_on=Exception)
        row = status_row()
        assert row["reachable"] is True and row["error"] is None
        text = _fogline("sites", "status", "--checkpoint-dir", str(ck)).stdout
        assert any(ln.split()[:4] == ["a", "canary", f"127.0.0.1:{wan.port}", "yes"] for ln in text.splitlines()), text
        assert not any(ln.startswith("  a: ") for ln in text.splitlines()), text   # no error line any more
        assert "rollout okm v1: done on a" in text, text
        assert wan.connections >= 2   # the coordinator reconnected by itself

        load.stop()
        print(f"cut {cut_s:.1f} s; reachable again {t_back - t_heal:.1f} s after the heal; svc answered "
              f"{load.ok} requests (+{cli_ok} via fogline infer), {len(load.failures)} failed; "
              f"total {time.monotonic() - t_start:.1f} s")
        assert not load.failures, load.failures[:5]
        assert load.ok >= 20, load.ok
    finally:
        if load is not None:
            load.stop()
        if service is not None:
            service.stop()
        wan.close()
        admin.close()
