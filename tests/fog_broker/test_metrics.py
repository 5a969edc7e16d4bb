"""Prometheus metrics of a running fog broker, scraped and parsed the way Prometheus would.

A real ``FogService`` on a real mosquitto with real edge agents (the agent code
with simulated device profiles, onnxruntime partitions) in this process; every
scrape goes through ``fog_broker.metrics.render`` and is parsed back with
``prometheus_client.parser``. Values are checked to move with real events: an
agent joining, a deploy and inferences, refused and unsigned requests, a
stranger's advert, a device crash with its recovery, and a revocation.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from runtime import codec
from runtime.broker import MosquittoBroker, find_mosquitto
from runtime.messages import ControlRequest
from runtime.mqtt import MqttClient
from runtime.topics import Topics

from waiting import wait_for

prometheus_client = pytest.importorskip("prometheus_client", reason="pip install 'fogline[fog]' (prometheus_client)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402 - after the importorskip

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
if find_mosquitto() is None:  # pragma: no cover - make test installs it
    pytest.skip("mosquitto not installed", allow_module_level=True)

SITE = "metrics"
T = Topics(SITE)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(svc: Any, **kw: Any) -> Samples:
    from fog_broker.metrics import render
    body, ctype = render(svc, **kw)
    assert ctype.startswith("text/plain")
    out: Samples = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; a missing sample reads as 0 (a counter that never moved)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


class Fleet:
    """A fog and its agents for this module; steps are idempotent, so any test can ask for them."""

    WORKERS: ClassVar[dict[str, str]] = {"w0": "pd0", "w1": "pd1", "w2": "pd2"}

    def __init__(self, broker: MosquittoBroker, tmp: Path) -> None:
        from fog_broker.service import FogService, ServiceConfig
        self.broker = broker
        self.tmp = tmp
        self.svc = FogService(ServiceConfig(data_dir=tmp / "fog", site=SITE, mqtt_port=broker.port,
                                            state_interval_s=1.0, summary_interval_s=5.0, trust_poll_s=0.05,
                                            verify_workers=1)).start()
        self.agents: dict[str, Any] = {}
        self.admin = self.issue("admin", "operator")
        self._client: Any = None
        self._deployed = False
        self._http: Any = None

    def issue(self, name: str, role: str) -> Path:
        return Path(self.svc.site.issue_credentials(name, role, self.tmp / "creds" / name, time.time()))

    @property
    def client(self) -> Any:
        from fog_broker.client import FogClient
        if self._client is None:
            self._client = FogClient("127.0.0.1", self.broker.port, credentials=self.admin, insecure=True)
        return self._client

    def start_agent(self, dev_id: str, memory: int, labels: dict[str, str], flops: float = 5e9) -> None:
        """What ``fogline devices add`` + ``fogline agent --insecure --fog-key`` do, in this process."""
        from edge_agent.agent import AgentConfig, load_identity
        from edge_agent.runner import make_agent
        from simulations.profiles import DeviceProfile
        d = self.tmp / "agents" / dev_id
        ident = load_identity(d, dev_id)
        self.svc.site.add_device(dev_id, ident.public_key_bytes, time.time())
        wait_for(lambda: dev_id in self.svc.device_keys, 5, f"{dev_id} trusted")
        prof = DeviceProfile(dev_id, flops=flops, memory_bytes=memory, uplink_bps=1e8, downlink_bps=1e8,
                             rtt_s=0.001, power_active_w=5.0, power_idle_w=2.0, labels=labels)
        cfg = AgentConfig(device_id=dev_id, data_dir=d, host="127.0.0.1", port=self.broker.port, site=SITE,
                          labels=labels, state_interval_s=1.0, keepalive=2, intra_op_threads=1,
                          status_file=False, fog_key=self.svc.identity.public_key_bytes, tls=None)
        self.agents[dev_id] = make_agent(cfg, profile=prof).start()

    def alive(self) -> set[str]:
        return set(self.svc.call(self.svc.registry.alive_ids))

    def started(self) -> Fleet:
        if not self.agents:
            import onnxruntime  # noqa: F401 - imported before agents start (a first import inside a deploy stalls)
            self.start_agent("cam", 1000, {"role": "source", "power-domain": "pd-cam"}, 1e8)
            for dev, pd in self.WORKERS.items():
                self.start_agent(dev, 400_000, {"role": "worker", "power-domain": pd})
            wait_for(lambda: self.alive() >= {"cam", *self.WORKERS}, 30, "4 agents alive")
        return self

    def deployed(self) -> Fleet:
        self.started()
        if not self._deployed:
            self.client.deploy({"name": "m", "model": "zoo:mlp", "source": "cam", "sink": "cam", "replicas": 2,
                                "selectors": {"role": "worker"}})
            self.client.wait_running("m", 40, replicas=2)
            self._deployed = True
        return self

    def infer(self, n: int) -> None:
        x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
        for _ in range(n):
            self.client.infer("m", {"x": x}, timeout=10)

    def hosts(self) -> list[str]:
        w = next(w for w in self.client.status(limit=0)["workloads"] if w["name"] == "m")
        return [p["device"] for r in w["placement"] for p in r["partitions"]]

    def http(self) -> Any:
        """The fog's HTTP API (``fogline broker --http``, plain HTTP on loopback) with /metrics and /site."""
        from fog_broker import metrics, site_page
        from fog_broker.http_api import HttpApi
        if self._http is None:
            if not hasattr(HttpApi, "extend"):
                pytest.skip("fog_broker.http_api.HttpApi has no extend() to add routes to")
            api = HttpApi(self.svc, "127.0.0.1", 0, tls_dir=None)
            api.extend(metrics.register_http)
            api.extend(site_page.register_http)
            self._http = api.start()
        return self._http

    def token(self, creds: Path) -> str:
        """``fogline api-token --credentials CREDS``."""
        import os

        from fog_broker.api_auth import mint_token
        from runtime.credentials import load_credentials
        c = load_credentials(creds)
        return mint_token(c.signing, c.fog.site, c.fog.fog_id, time.time(), 600, os.urandom(8))

    def close(self) -> None:
        if self._http is not None:
            self._http.stop()
        if self._client is not None:
            self._client.close()
        for a in self.agents.values():
            a.stop(timeout=1.0)
        self.svc.stop()


@pytest.fixture(scope="module")
def fleet(mosquitto_module: MosquittoBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(mosquitto_module, tmp_path_factory.mktemp("metrics"))
    try:
        yield f
    finally:
        f.close()


def test_an_agent_joining_shows_up_in_devices_and_advert_ingest(fleet: Fleet) -> None:
    before = scrape(fleet.svc)
    assert val(before, "fogline_fog_owner_responsive") == 1
    info = [k for k in before if k[0] == "fogline_fog_info"]
    assert len(info) == 1 and ("site", SITE) in info[0][1] and ("secure", "false") in info[0][1]
    fleet.started()
    after = scrape(fleet.svc)
    assert val(after, "fogline_fog_devices", state="live") - val(before, "fogline_fog_devices", state="live") == 4
    assert val(after, "fogline_fog_devices", state="dead") == 0
    assert val(after, "fogline_fog_adverts_accepted_total", kind="BIRTH") \
        >= val(before, "fogline_fog_adverts_accepted_total", kind="BIRTH") + 4
    assert val(after, "fogline_fog_adverts_accepted_total", kind="STATE") >= 1
    # the scrape is a snapshot, not a stream: another scrape with nothing new agrees on the counters
    again = scrape(fleet.svc)
    assert val(again, "fogline_fog_deploys_total") == val(after, "fogline_fog_deploys_total")


def test_deploy_placements_inference_and_refused_inference(fleet: Fleet) -> None:
    before = scrape(fleet.started().svc)
    fleet.deployed()
    fleet.infer(3)
    from fog_broker.client import InferenceError
    with pytest.raises(InferenceError):
        fleet.client.infer("nope", {"x": np.zeros((1, 64), np.float32)}, timeout=5)
    after = scrape(fleet.svc)

    def d(name: str, **lb: str) -> float:
        return val(after, name, **lb) - val(before, name, **lb)

    assert d("fogline_fog_deploys_total") >= 2           # two replicas, one partition each at least
    assert val(after, "fogline_fog_placements", workload="m", phase="running") >= 2
    assert val(after, "fogline_fog_placements", workload="m", phase="lost") == 0
    assert val(after, "fogline_fog_workload_replicas", workload="m") == 2
    assert val(after, "fogline_fog_workload_replicas_healthy", workload="m") == 2
    assert val(after, "fogline_fog_workloads", status="running") >= 1
    assert d("fogline_fog_inference_requests_total", outcome="answered") == 3
    assert d("fogline_fog_inference_requests_total", outcome="refused") == 1
    assert d("fogline_fog_control_requests_total", action="deploy") == 1
    assert val(after, "fogline_fog_workload_predicted_latency_seconds", workload="m") > 0
    assert val(after, "fogline_fog_utilization_ratio") > 0


def test_inference_latency_histogram_per_workload(fleet: Fleet) -> None:
    if not hasattr(fleet.deployed().svc.router, "latency_histograms"):
        pytest.skip("fog_broker.router has no latency_histograms yet: the observation API this module reads "
                    "(see fog_broker/metrics.py) is not merged")
    before = scrape(fleet.svc)
    fleet.infer(4)
    after = scrape(fleet.svc)
    name = "fogline_fog_inference_latency_seconds"
    assert val(after, f"{name}_count", workload="m") - val(before, f"{name}_count", workload="m") == 4
    assert val(after, f"{name}_sum", workload="m") > val(before, f"{name}_sum", workload="m")
    assert val(after, f"{name}_bucket", workload="m", le="+Inf") == val(after, f"{name}_count", workload="m")
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                     if k[0] == f"{name}_bucket" and dict(k[1]).get("workload") == "m")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative


def test_refused_requests_strangers_and_pending_reasons(fleet: Fleet) -> None:
    from fog_broker.client import ControlError, FogClient
    fleet.started()
    app = fleet.issue("camera-app", "app")
    wait_for(lambda: "camera-app" in fleet.svc.control.roles, 5, "app identity known")
    before = scrape(fleet.svc)
    with FogClient("127.0.0.1", fleet.broker.port, credentials=app, insecure=True) as ac, \
            pytest.raises(ControlError, match="may not"):
        ac.control("status", timeout=5)
    raw = MqttClient(f"metrics-raw-{time.time_ns()}", "127.0.0.1", fleet.broker.port)
    raw.start()
    assert raw.wait_connected(5)
    raw.publish(T.control("x"), codec.encode(ControlRequest("r1", "status", T.reply("x")))).wait(2)
    raw.publish(T.device("stranger", "STATE"), b"\x00not an advert").wait(2)
    raw.stop()
    fleet.client.deploy({"name": "npu", "model": "zoo:mlp", "source": "cam", "sink": "cam",
                         "selectors": {"accelerator": "npu"}})

    def moved() -> Samples | None:
        s = scrape(fleet.svc)
        ok = (val(s, "fogline_fog_message_rejections_total", reason="unsigned")
              > val(before, "fogline_fog_message_rejections_total", reason="unsigned")
              and val(s, "fogline_fog_advert_rejections_total", reason="unknown sender")
              > val(before, "fogline_fog_advert_rejections_total", reason="unknown sender")
              and val(s, "fogline_fog_pending_workloads", reason="selector") >= 1)
        return s if ok else None
    after = wait_for(moved, 10, "rejections and the pending workload counted")
    # signed and fresh, but an app may not ask for the status: refused by the control plane
    assert val(after, "fogline_fog_control_refusals_total", reason="refused") \
        - val(before, "fogline_fog_control_refusals_total", reason="refused") == 1
    assert val(after, "fogline_fog_workload_pending", workload="npu", reason="selector") == 1
    assert val(after, "fogline_fog_workloads", status="pending") >= 1
    assert val(after, "fogline_fog_identities", role="app", state="active") >= 1
    fleet.client.delete("npu")

    def cleared() -> Samples | None:
        s = scrape(fleet.svc)
        return s if val(s, "fogline_fog_pending_workloads", reason="selector") == 0 else None
    gone = wait_for(cleared, 10, "pending workload gone")
    assert ("fogline_fog_workload_pending", frozenset({("workload", "npu"), ("reason", "selector")})) not in gone


def test_device_crash_recovery_then_revocation(fleet: Fleet) -> None:
    fleet.deployed()
    before = scrape(fleet.svc)
    victim = fleet.hosts()[0]
    fleet.agents[victim].stop(crash=True)  # the socket drops as with kill -9: the broker sends the Will

    def recovered() -> Samples | None:
        s = scrape(fleet.svc)
        ok = (val(s, "fogline_fog_devices", state="dead") == 1
              and val(s, "fogline_fog_recovery_seconds_count") > val(before, "fogline_fog_recovery_seconds_count")
              and val(s, "fogline_fog_workload_replicas_healthy", workload="m") == 2)
        return s if ok else None
    after = wait_for(recovered, 30, "the lost replica re-placed and running")
    assert val(after, "fogline_fog_device_losses_total") - val(before, "fogline_fog_device_losses_total") == 1
    assert val(after, "fogline_fog_devices", state="live") == val(before, "fogline_fog_devices", state="live") - 1
    assert val(after, "fogline_fog_recovery_seconds_bucket", le="+Inf") == \
        val(after, "fogline_fog_recovery_seconds_count")
    assert 0 < val(after, "fogline_fog_recovery_seconds_sum") < 30 * val(after, "fogline_fog_recovery_seconds_count")

    # a revocation (fogline devices revoke) cuts a live host off: counted, and gone from the registry
    target = next(d for d in fleet.hosts() if d != victim)
    fleet.svc.site.revoke_device(target, time.time(), "stolen")

    def revoked() -> Samples | None:
        s = scrape(fleet.svc)
        return s if val(s, "fogline_fog_devices_revoked_total") >= 1 else None
    rv = wait_for(revoked, 10, "revocation counted")
    assert val(rv, "fogline_fog_enrolment", state="revoked") == 1
    assert val(rv, "fogline_fog_device_losses_total") - val(after, "fogline_fog_device_losses_total") == 1
    assert val(rv, "fogline_fog_devices", state="live") == val(after, "fogline_fog_devices", state="live") - 1


def test_openmetrics_and_a_stuck_owner_thread(fleet: Fleet) -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

    from fog_broker.metrics import FogCollector, render
    body, ctype = render(fleet.svc, accept="application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    names = {f.name for f in om_families(body.decode())}
    assert {"fogline_fog_devices", "fogline_fog_adverts_accepted", "fogline_fog_recovery_seconds"} <= names
    # the owner thread busy for a while: the scrape still answers, and says the loop is not answering
    release = threading.Event()
    blocker = threading.Thread(target=lambda: fleet.svc.call(lambda: release.wait(5), timeout=10), daemon=True)
    blocker.start()
    try:
        time.sleep(0.1)
        fams = {f.name: f for f in FogCollector(fleet.svc, timeout_s=0.3).collect()}
        assert fams["fogline_fog_owner_responsive"].samples[0].value == 0
        assert "fogline_fog_devices" not in fams
    finally:
        release.set()
        blocker.join(10)
    assert val(scrape(fleet.svc), "fogline_fog_owner_responsive") == 1


def test_metrics_and_the_site_page_on_the_fogs_http_api(fleet: Fleet) -> None:
    """The routes ``register_http`` adds to the real HTTP API: the same authentication as inference."""
    import json
    import urllib.error
    import urllib.request
    pytest.importorskip("aiohttp", reason="the HTTP API needs aiohttp: pip install 'fogline[fog]'")
    api = fleet.started().http()
    base = f"http://127.0.0.1:{api.port}"

    def get(path: str, token: str | None = None, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if accept:
            headers["Accept"] = accept
        try:
            with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=10) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    assert get("/metrics")[0] == 401
    app = fleet.issue("dashboard-app", "app")
    wait_for(lambda: "dashboard-app" in fleet.svc.control.roles, 5, "app identity known")
    code, _, body = get("/metrics", fleet.token(app))
    assert code == 403 and "may not status" in json.loads(body)["error"]
    code, headers, body = get("/metrics", fleet.token(fleet.admin))
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    live = next(s.value for s in fams["fogline_fog_devices"].samples if s.labels["state"] == "live")
    assert live == len(fleet.alive()) and fams["fogline_fog_owner_responsive"].samples[0].value == 1
    code, headers, _ = get("/metrics", fleet.token(fleet.admin), "application/openmetrics-text; version=1.0.0")
    assert code == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    # the page: static, no data, served with its CSP; its data needs the status right
    code, headers, body = get("/site")
    assert code == 200 and b'content="site.json"' in body and "script-src 'sha256-" in headers[
        "Content-Security-Policy"]
    assert get("/site.json")[0] == 401 and get("/site.json", fleet.token(app))[0] == 403
    code, _, body = get("/site.json", fleet.token(fleet.admin))
    doc = json.loads(body)
    assert code == 200 and doc["site"] == SITE
    assert {d["id"] for g in doc["domains"] for d in g["devices"]} >= fleet.alive()


def test_every_counter_of_a_snapshot_is_exported_once() -> None:
    """Pure: the routing table sends each counter to one metric; unknown ones land in events_total."""
    from fog_broker.metrics import METRICS, families
    snap = {
        "status": {"fog_id": "f", "site": "s", "epoch": 1, "metrics": {}, "workloads": [],
                   "counters": {"router.answered": 5, "router.accepted": 6, "control.ok:status": 2,
                                "control.rejected:stale": 1, "control.refused": 1, "controller.plans": 3,
                                "controller.deploys": 4, "registry.stale": 7, "verifier.accepted": 9,
                                "verifier.replayed": 1, "in:BIRTH": 99}},
        "service": {"devices_lost": 1, "rejected:unsigned": 2, "release:stale": 1, "brand_new": 3},
        "ingest": {"in:BIRTH": 2, "rejected:replayed": 1, "verify_overflow": 4},
        "recoveries_s": [0.2], "in_flight": 1, "latency": {}, "identities": [],
    }
    got: Samples = {}
    for fam in families(snap):
        assert fam.name.removeprefix("fogline_fog_").removesuffix("_info") in METRICS or fam.name == "fogline_fog"
        for s in fam.samples:
            got[(s.name, frozenset(s.labels.items()))] = s.value
    assert val(got, "fogline_fog_inference_requests_total", outcome="answered") == 5
    assert val(got, "fogline_fog_control_requests_total", action="status") == 2
    assert val(got, "fogline_fog_control_refusals_total", reason="stale") == 1
    assert val(got, "fogline_fog_control_refusals_total", reason="refused") == 1
    assert val(got, "fogline_fog_controller_events_total", event="plans") == 3
    assert val(got, "fogline_fog_adverts_accepted_total", kind="BIRTH") == 2      # ingest's own, not the merge
    assert val(got, "fogline_fog_advert_rejections_total", reason="replayed") == 1
    assert val(got, "fogline_fog_message_rejections_total", reason="unsigned") == 2
    assert val(got, "fogline_fog_release_refusals_total", reason="stale") == 1
    assert val(got, "fogline_fog_dropped_total", queue="verify") == 4
    assert val(got, "fogline_fog_events_total", counter="brand_new") == 3
    assert val(got, "fogline_fog_events_total", counter="registry.stale") == 7
    assert val(got, "fogline_fog_inference_in_flight") == 1
    # nothing counted twice: accepted (= answered + failed + in flight) and the controller's
    # deploy commands (behind deploys_total) are not exported on their own
    assert not any(dict(k[1]).get("counter", "").endswith(("accepted", "deploys")) for k in got)
    assert not any(dict(k[1]).get("event") == "deploys" for k in got)


# ------------------------------------------------------------------ deploy/: the files that use these metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _fogline_args(argv: list[str]) -> Any:
    """``fogline ARGS`` parsed by the real command line (unknown flags and bad values fail the test).

    Paths name the target host's files (``/etc/fogline/...``), not this machine's: the path
    types that look at the file system are swapped for plain paths; every other check stays.
    """
    import argparse

    from runtime.cli import build_parser

    host_paths = {"existing_dir", "existing_file", "writable_dir", "writable_file"}

    def relax(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if getattr(action.type, "kind", None) in host_paths:
                action.type = Path
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    relax(sub)

    parser = build_parser()
    relax(parser)
    return parser.parse_args(argv)


def _compose_env(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}`` interpolation."""
    import re
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1), m.group(2) or ""), text)


def test_grafana_dashboard_queries_only_metrics_the_fog_exports() -> None:
    import json
    import re

    from fog_broker.metrics import METRICS, PREFIX
    dash = json.loads((DEPLOY / "grafana" / "fogline-fog.json").read_text())
    assert dash["uid"] == "fogline-fog" and dash["panels"]
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    exported = set()
    for short, (kind, _, _) in METRICS.items():
        base = f"{PREFIX}_{short}"
        exported |= {f"{base}_total"} if kind == "counter" else {base}
        if kind == "histogram":
            exported |= {f"{base}_bucket", f"{base}_count", f"{base}_sum"}
    used = {n for e in exprs for n in re.findall(rf"\b{PREFIX}_[a-z_]+\b", e)}
    assert used and used <= exported, used - exported
    # every panel reads its data source from the dashboard's variable, every query filters by site
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"] if p["type"] != "row")
    assert all('site=~"$site"' in e for e in exprs if "label_values" not in e)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_compose_files_parse_and_run_real_commands() -> None:
    yaml = pytest.importorskip("yaml")
    site = yaml.safe_load((DEPLOY / "compose" / "site.yaml").read_text())
    coord = yaml.safe_load((DEPLOY / "compose" / "coordinator.yaml").read_text())
    assert set(site["services"]) == {"fog", "prometheus", "grafana"}
    assert set(coord["services"]) == {"coordinator"}
    for doc, path in ((site, "site.yaml"), (coord, "coordinator.yaml")):
        for name, svc in doc["services"].items():
            for vol in svc.get("volumes", ()):
                src = vol.split(":")[0]
                if src.startswith("."):  # a file of this repository (credentials are the operator's)
                    assert (DEPLOY / "compose" / src).exists() or "credentials" in src, (path, name, src)
                else:
                    assert src in doc.get("volumes", {}), (path, name, src)
            if "build" in svc:
                ctx = (DEPLOY / "compose" / svc["build"]["context"]).resolve()
                assert (ctx / svc["build"]["dockerfile"]).exists() and (ctx / "pyproject.toml").exists()
                assert svc.get("read_only") and svc.get("cap_drop") == ["ALL"]
                assert "no-new-privileges:true" in svc.get("security_opt", ())
    # the fog broker starts and owns mosquitto itself: no mosquitto service, mosquitto in the image
    assert not any("mosquitto" in str(s.get("image", "")) for s in site["services"].values())
    assert "mosquitto" in (DEPLOY / "docker" / "Dockerfile").read_text()
    env = {"FOGLINE_SITE": "farm", "FOGLINE_SAN": "gateway.local", "FOGLINE_COORDINATOR_HOST": "coord.example",
           "FOGLINE_FOG": "gateway.example:8883"}
    fog = yaml.safe_load(_compose_env((DEPLOY / "compose" / "site.yaml").read_text(), env))["services"]["fog"]
    args = _fogline_args(fog["command"])
    assert args.command == "broker" and args.http == 8443 and args.site == "farm" and args.host == "0.0.0.0"
    cmd = yaml.safe_load(_compose_env((DEPLOY / "compose" / "coordinator.yaml").read_text(), env))
    args = _fogline_args(cmd["services"]["coordinator"]["command"])
    assert args.command == "coordinator" and args.mqtt == "gateway.example:8883" and len(args.replica_dir) == 2
    # Prometheus and Grafana provisioning
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["scheme"] == "https" and "cert_file" in job["tls_config"]
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "fogline.yaml").read_text())


def _unit(path: Path) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file (every section), repeated keys kept in order."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


@pytest.mark.parametrize("name,env_file", [("fogline-broker", "broker.env.example"),
                                           ("fogline-agent", "agent.env.example"),
                                           ("fogline-site-aggregator", "site-aggregator.env.example")])
def test_systemd_units_are_hardened_and_run_real_commands(name: str, env_file: str, tmp_path: Path) -> None:
    import shlex
    import shutil
    import subprocess
    import sys
    path = DEPLOY / "systemd" / f"{name}.service"
    u = _unit(path)
    assert u["User"] == ["fogline"] and u["NoNewPrivileges"] == ["yes"] and u["ProtectSystem"] == ["strict"]
    assert u["ReadWritePaths"] == ["/var/lib/fogline"] and u["CapabilityBoundingSet"] == [""]
    assert u["Restart"][0] in ("on-failure", "always") and u["ProtectHome"] == ["yes"]
    # the command line, with the example settings, is one the real parser accepts
    env = dict(line.split("=", 1) for line in (DEPLOY / "systemd" / env_file).read_text().splitlines()
               if line and not line.startswith("#"))
    (var,) = env
    argv = shlex.split(u["ExecStart"][0].replace("%H", "pi-barn-1").replace(f"${var}", env[var]))
    assert argv[0] == "/opt/fogline/venv/bin/fogline"
    args = _fogline_args(argv[1:])
    assert str(getattr(args, "data_dir", None) or args.work_dir).startswith("/var/lib/fogline/")
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: parsed by hand only")
    # systemd's own checks, on a copy whose ExecStart exists here
    unit = tmp_path / path.name
    unit.write_text(path.read_text().replace("/opt/fogline/venv/bin/fogline", str(Path(sys.executable).parent /
                                                                                   "fogline")))
    res = subprocess.run([analyze, "verify", str(unit)], check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    # exposure at most 3.0 of 10 ("OK"); the threshold is given in tenths
    res = subprocess.run([analyze, "security", "--offline=true", "--threshold=30", str(unit)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr
