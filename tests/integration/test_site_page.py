"""The site page in headless Chromium, fed from a real fog broker's status.

``fogline broker`` is started the README way (``LocalSite``: its own CA, mosquitto
with TLS and an ACL); edge agents (the agent code with simulated device
profiles) enrol with a bootstrap token over the real enrolment service and
connect over TLS. A minimal stdlib HTTP server serves ``site_page.page_html()``
with its Content-Security-Policy and ``page_json(FogClient.status())``; Chromium
loads it through chromedriver (selenium). Checked in the DOM: one box per
device grouped by power domain, partitions coloured per workload, replica
chains drawn as arrows, a pending reason, a device killed mid-test shown dead
(the page refreshes by itself) with the fault listed; no console errors (so the
CSP lets the page's own script and style run). The DOM is read in one script
run per check (the page re-renders on every poll). A screenshot is written to the
test's tmp dir (``site-page.png``).
"""
from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from waiting import wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

WORKERS = {"w0": "pd0", "w1": "pd1", "w2": "pd2"}
DOM_SNAPSHOT = """
const q = (sel, root) => Array.from((root || document).querySelectorAll(sel));
return {
  domains: q('.domain').map(g => ({name: g.dataset.domain, devices: q('.device', g).map(e => e.dataset.device)})),
  devices: Object.fromEntries(q('.device[data-device]').map(e => [e.dataset.device, e.dataset.status])),
  parts: q('.part[data-part]').map(e => ({id: e.dataset.part, workload: e.dataset.workload, health: e.dataset.health,
                                          device: e.closest('.device').dataset.device,
                                          bg: getComputedStyle(e).backgroundColor})),
  chains: q('#chains path[data-chain]').map(e => e.getAttribute('data-chain')),
  pending: q('#pending li[data-workload]').map(e => ({workload: e.dataset.workload, gate: e.dataset.gate,
                                                       text: e.textContent})),
  faults: q('#faults li[data-kind]').map(e => ({device: e.dataset.device || '', kind: e.dataset.kind,
                                                 text: e.textContent})),
  workloads: Object.fromEntries(q('#workloads tr[data-workload]').map(
      tr => [tr.dataset.workload, q('td', tr).map(td => td.textContent)])),
  conn: document.getElementById('conn').className,
};
"""


class Agents:
    """Edge agents in this process, enrolled with one bootstrap token like ``fogline agent --token``."""

    def __init__(self, site: LocalSite, tmp: Path) -> None:
        self.site = site
        self.tmp = tmp
        self.running: dict[str, Any] = {}

    def start(self, specs: list[dict[str, Any]]) -> None:
        from edge_agent.agent import AgentConfig
        from edge_agent.credentials import enrolled_settings
        from edge_agent.enrol import enrol_dirs
        from edge_agent.runner import make_agent
        from simulations.profiles import DeviceProfile
        host, port = self.site.enroll.rsplit(":", 1)
        dirs = [(a["id"], self.tmp / "agents" / a["id"]) for a in specs]
        enrol_dirs(self.site.token(uses=len(specs)), dirs, host, int(port), timeout_s=60)
        for a in specs:
            d = self.tmp / "agents" / a["id"]
            fog_key, tls, site_name = enrolled_settings(d)
            prof = DeviceProfile(a["id"], flops=a.get("flops", 5e9), memory_bytes=a["memory"], uplink_bps=1e8,
                                 downlink_bps=1e8, rtt_s=0.001, power_active_w=5.0, power_idle_w=2.0,
                                 labels=a["labels"])
            cfg = AgentConfig(device_id=a["id"], data_dir=d, host="127.0.0.1", port=self.site.port, site=site_name,
                              labels=a["labels"], fog_key=fog_key, tls=tls, state_interval_s=1.0, keepalive=2,
                              intra_op_threads=1, status_file=False)
            self.running[a["id"]] = make_agent(cfg, profile=prof).start()

    def crash(self, dev: str) -> None:
        self.running[dev].stop(crash=True)  # the socket drops first, as with kill -9: the broker sends the Will

    def stop(self) -> None:
        for a in self.running.values():
            a.stop(timeout=1.0)


class PageServer:
    """``GET /`` the page (with its CSP), ``GET /site.json`` the page document of the fog's status now."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        from fog_broker.site_page import page_headers, page_html, page_json
        lock = threading.Lock()
        served: list[int] = [0]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/":
                    body, headers = page_html("site.json", refresh_s=0.5), page_headers()
                elif self.path == "/site.json":
                    with lock:
                        body = page_json(status())
                    served[0] += 1
                    headers = {"Content-Type": "application/json", "Cache-Control": "no-store"}
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.served = served
        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="page-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def need_browser() -> None:
    """Skip (with what to install) when mosquitto, Chromium, chromedriver or selenium is missing."""
    if find_mosquitto() is None:  # pragma: no cover - make test installs it
        pytest.skip("mosquitto not installed")
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):  # pragma: no cover
        pytest.skip("headless Chromium is not installed: apt-get install -y chromium chromium-driver "
                    "(make test installs both as root)")
    pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install -e '.[dev]'")


def chromium() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 "--window-size=1500,1100", "--force-device-scale-factor=1"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))


@pytest.fixture
def site(tmp_path: Path) -> Iterator[LocalSite]:
    need_browser()
    s = LocalSite(tmp_path / "fog", site="farm", log=tmp_path / "fog.log",
                  args=["--state-interval", "1", "--startup-wait", "2", "--summary-interval", "1"]).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_site_page_in_headless_chromium(site: LocalSite, tmp_path: Path) -> None:
    import onnxruntime  # noqa: F401 - imported before agents start (a first import inside a deploy stalls them)
    agents = Agents(site, tmp_path)
    client = site.client()
    page = None
    driver = None
    try:
        agents.start([{"id": "cam", "memory": 1000, "flops": 1e8,
                       "labels": {"role": "source", "power-domain": "pd-cam"}},
                      {"id": "gw", "memory": 400_000, "labels": {"role": "spare"}},
                      *({"id": d, "memory": 400_000, "labels": {"role": "worker", "power-domain": pd}}
                        for d, pd in WORKERS.items())])
        everyone = {"cam", "gw", *WORKERS}
        wait_for(lambda: {d["id"] for d in client.status()["devices"] if d["alive"]} >= everyone,
                 30, "agents alive", retry_on=Exception)
        client.deploy({"workloads": [
            {"name": "res", "model": "zoo:resnet", "source": "cam", "sink": "cam", "selectors": {"role": "worker"}},
            {"name": "mlp2", "model": "zoo:mlp", "source": "cam", "sink": "cam", "replicas": 2,
             "selectors": {"role": "worker"}},
            {"name": "npu", "model": "zoo:mlp", "source": "cam", "sink": "cam",
             "selectors": {"accelerator": "npu"}},
        ]})
        res = client.wait_running("res", 40)
        client.wait_running("mlp2", 40)
        res_parts = [p for r in res["placement"] for p in r["partitions"]]
        assert len(res_parts) >= 2, res  # 513 KB of resnet on 400 KB devices: a chain across devices
        import numpy as np
        for _ in range(3):  # measured latency for the workloads table
            client.infer("mlp2", {"x": np.zeros((1, 64), np.float32)}, timeout=10)

        page = PageServer(lambda: client.status())
        driver = chromium()
        driver.get(page.url)

        def dom() -> dict[str, Any]:
            """What the page shows, read in one script run: the page re-renders between two calls."""
            return dict(driver.execute_script(DOM_SNAPSHOT))

        def shows(pred: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> dict[str, Any]:
            """The first DOM snapshot for which ``pred`` holds (the page polls by itself)."""
            return dict(wait_for(lambda: x if pred(x := dom()) else None, timeout, what,
                                 retry_on=Exception))

        d = shows(lambda x: x["devices"].keys() == everyone and x["chains"], 20, "the map")
        # devices grouped by power domain; the spare without one in its own group, last
        assert [g["name"] for g in d["domains"]] == ["pd-cam", "pd0", "pd1", "pd2", "no power domain"], d
        assert {g["name"]: g["devices"] for g in d["domains"]}["pd1"] == ["w1"]
        assert set(d["devices"].values()) == {"live"}
        # partitions on their devices, coloured by workload; the chain of res drawn hop by hop
        parts = {p["id"]: p for p in d["parts"]}
        for p in res_parts:
            shown = parts[f"res/r0/p{p['index']}"]
            assert shown["device"] == p["device"] and shown["health"] == "ok", shown
        colours = {w: {p["bg"] for p in d["parts"] if p["workload"] == w} for w in ("res", "mlp2")}
        assert len(colours["res"]) == 1 and len(colours["mlp2"]) == 1 and colours["res"] != colours["mlp2"]
        assert d["chains"].count("res/r0") == len(res_parts) - 1, d["chains"]
        assert sum(p["workload"] == "mlp2" for p in d["parts"]) == 2
        # why npu is pending; nothing has failed yet; measured latency in the workloads table
        assert any(x["workload"] == "npu" and x["gate"] == "selector" and "accelerator=npu" in x["text"]
                   for x in d["pending"]), d["pending"]
        assert not [f for f in d["faults"] if f["device"]]
        cells = d["workloads"]["mlp2"]
        assert cells[2] == "2 / 2" and cells[4].endswith("ms"), cells  # measured p50

        # kill one device of res's chain: the page shows it dead and lists the fault, by itself
        victim = res_parts[0]["device"]
        served = page.served[0]
        agents.crash(victim)
        shows(lambda x: x["devices"].get(victim) == "dead", 20, "victim shown dead")
        assert page.served[0] > served  # it got there by polling
        d = shows(lambda x: any(f["device"] == victim for f in x["faults"]), 10, "fault listed")
        fault = next(f for f in d["faults"] if f["device"] == victim)
        assert fault["kind"] == "device lost" and "connection dropped" in fault["text"], fault
        # once res is re-placed, its new chain is drawn again, on live devices only
        wait_for(lambda: (w := next(w for w in client.status()["workloads"] if w["name"] == "res"))
                 ["healthy_replicas"] == 1 and victim not in {p["device"] for r in w["placement"]
                                                              for p in r["partitions"]},
                 30, "res re-placed", retry_on=Exception)

        def res_back(x: dict[str, Any]) -> bool:
            res_shown = [p for p in x["parts"] if p["workload"] == "res"]
            return bool(res_shown) and all(p["health"] == "ok" and p["device"] != victim for p in res_shown) \
                and x["chains"].count("res/r0") == len(res_shown) - 1
        d = shows(res_back, 15, "the page shows res running again")
        assert d["conn"] == "" and d["devices"][victim] == "dead"
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not errors, errors
        height = int(driver.execute_script("return document.documentElement.scrollHeight"))
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",  # the whole page in one picture
                               {"width": 1500, "height": height + 20, "deviceScaleFactor": 1, "mobile": False})
        time.sleep(0.8)  # a refresh and a redraw at the new size
        shot = tmp_path / "site-page.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        if driver is not None:
            driver.quit()
        if page is not None:
            page.close()
        client.close()
        agents.stop()


# ------------------------------------------------------------------ the page document (pure, no browser)


def _status(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "site": "farm", "fog_id": "fog-farm", "epoch": 3, "ready": True, "secure": True, "uptime_s": 12.5,
        "devices": [
            {"id": "w0", "alive": True, "status": "live", "labels": {"power-domain": "pd0"}, "memory_bytes": 400_000,
             "free_memory_bytes": 100_000, "last_seen_s": 0.3, "lost_reason": None, "flags": [],
             "partitions": ["res/v2/r0/p0:running", "res/v1/r0/p0:loading"]},
            {"id": "w1", "alive": True, "status": "live", "labels": {"power-domain": "pd1"}, "memory_bytes": 400_000,
             "free_memory_bytes": 100_000, "last_seen_s": 0.2, "lost_reason": None, "flags": [],
             "partitions": ["res/v2/r0/p1:failed"]},
            {"id": "cam", "alive": False, "status": "dead", "labels": {}, "memory_bytes": 1000,
             "free_memory_bytes": None, "last_seen_s": 4.0, "lost_reason": "will", "flags": ["implausible flops"],
             "partitions": []},
        ],
        "devices_total": 4, "enrolment": {"pending": ["pi-9"], "revoked": []},
        "workloads": [
            {"name": "res", "version": 2, "status": "running", "replicas": 1, "healthy_replicas": 1,
             "placement": [{"replica": 0, "latency_s": 0.012, "partitions": [
                 {"index": 1, "segments": [4, 7], "device": "w1", "phase": "running", "reason": None},
                 {"index": 0, "segments": [0, 3], "device": "w0", "phase": "running", "reason": None},
                 ]}],
             "reasons": {}, "latency": {"predicted_s": 0.012, "measured_p50_s": float("nan")}},
            {"name": "npu", "version": 1, "status": "pending", "replicas": 1, "healthy_replicas": 0,
             "placement": [{"replica": 0, "partitions": [
                 {"index": 0, "segments": [0, 2], "device": "w9", "phase": "pending", "reason": None}]}],
             "reasons": {"selector": "no alive device matches selector accelerator=npu", "fit": "0/3 devices fit"}},
        ],
        "metrics": {"devices_live": 2, "devices_suspect": 0, "devices_dead": 1, "utilization": 0.4,
                    "fragmentation": 0.1},
        "recoveries_s": [0.3, 0.1, 0.2],
    }
    doc.update(over)
    return doc


def test_page_data_groups_devices_places_partitions_and_explains() -> None:
    from fog_broker.site_page import NO_DOMAIN, page_data, page_json, workload_colour
    d = page_data(_status())
    assert [g["name"] for g in d["domains"]] == ["pd0", "pd1", NO_DOMAIN]
    devs = {dv["id"]: dv for g in d["domains"] for dv in g["devices"]}
    assert devs["w9"]["status"] == "unlisted"       # placed on a device this page of the status does not list
    parts = {p["id"]: p for dv in devs.values() for p in dv["partitions"]}
    assert parts["res/r0/p0"]["health"] == "ok" and parts["res/r0/p0"]["reported"] == "running"
    assert parts["res/r0/p1"]["health"] == "lost"   # placed and running, but the device reports it failed
    assert parts["res/v1/r0/p0"]["health"] == "orphan"  # an old version still on w0
    assert {p["colour"] for p in parts.values() if p["workload"] == "res"} == {workload_colour("res")}
    res = next(w for w in d["workloads"] if w["name"] == "res")
    assert [h["part"] for h in res["chains"][0]["hops"]] == ["res/r0/p0", "res/r0/p1"]  # in chain order
    assert res["chains"][0]["healthy"] is False
    assert res["measured_p50_s"] is None            # NaN never reaches the browser
    assert [(p["workload"], p["gate"]) for p in d["pending"]] == [("npu", "fit"), ("npu", "selector")]
    assert d["faults"] == [{"kind": "device lost", "device": "cam", "reason": "connection dropped (MQTT will)",
                            "ago_s": 4.0, "partitions": []}]
    assert d["recoveries"] == {"count": 3, "last_s": [0.3, 0.1, 0.2], "p50_s": 0.2, "max_s": 0.3}
    assert d["truncated"] and d["devices_total"] == 4 and d["summary"]["enrolment"]["pending"] == ["pi-9"]
    import json
    assert json.loads(page_json(_status())) == d


def test_page_data_uses_the_fogs_event_log_when_the_status_has_one() -> None:
    from fog_broker.site_page import page_data
    events = [{"at": 100.0, "kind": "device lost", "device": "w1", "reason": "will"},
              {"at": 101.0, "kind": "recovered", "device": "w2", "reason": "res/r0/p1 running again"}]
    d = page_data(_status(events=events))
    assert [f["kind"] for f in d["faults"]] == ["recovered", "device lost"]  # newest first


def test_page_html_and_its_content_security_policy() -> None:
    import base64
    import hashlib
    import re

    from fog_broker.site_page import content_security_policy, page_headers, page_html
    text = page_html('data.json?x="><script>', refresh_s=0.1).decode()
    assert '<meta name="fogline-endpoint" content="data.json?x=&quot;&gt;&lt;script&gt;">' in text
    assert '<meta name="fogline-refresh-s" content="0.5">' in text
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "").replace(
        '"http://www.w3.org/2000/svg"', "")  # nothing fetched from anywhere else (no CDN)
    script = re.search(r"<script>(.*?)</script>", text, re.DOTALL)
    assert script is not None
    digest = base64.b64encode(hashlib.sha256(script.group(1).encode()).digest()).decode()
    csp = content_security_policy()
    assert f"'sha256-{digest}'" in csp and "'unsafe-inline'" not in csp and "connect-src 'self'" in csp
    assert page_headers()["Content-Security-Policy"] == csp
    assert "innerHTML" not in text  # device-supplied strings are only ever text
