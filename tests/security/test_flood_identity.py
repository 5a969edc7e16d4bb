"""Issue 20, finding 4: no per-identity rate limit.

Before: one enrolled device replaying one signed state 144k times in 25 s made inference time
out and got all three real devices declared dead (one stayed dead 30 s after the flood), and an
app identity flooding ``fog/CTL`` stalled another identity's status replies for up to 9.7 s.
Now every sender has a budget per message kind, taken before any decode or signature check;
the excess is dropped and counted per sender, a sender that keeps flooding is quarantined
(with the reason in ``fogline status``) and its write rights leave the broker's ACL meanwhile
(the rest of its flood stops at mosquitto instead of queueing ahead of everyone on the fog's
connection), and a device's liveness traffic goes ahead of bulk.

The site is started the way the README says (TLS, ACL), with three real agents serving
``zoo:mlp``. The attackers hold real credentials: a device enrolled with a bootstrap token
(certificate and device key) and an app identity from ``fogline operators add``. Each floods
from its own process at full speed for 20 s.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from _agent_harness import REPO, kill, wait_status
from _chaos_harness import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

REAL = ("dev-a", "dev-b", "dev-c")
EVIL, APP = "evil", "app-flood"
FLOOD_S = 20.0

# The attacker: its own process (its own CPU, as on the LAN), publishing at full speed for
# ``seconds`` with at most 1,000 messages in flight (QoS 1), cycling through ``frames`` after
# publishing ``once`` a single time each. Prints {"sent": N}.
FLOODER = r"""
import json, sys, time
from runtime.mqtt import MqttClient, TlsConfig
spec = json.loads(open(sys.argv[1]).read())
frames = [(t, bytes.fromhex(p)) for t, p in spec["frames"]]
c = MqttClient(spec["client_id"], "127.0.0.1", spec["port"], tls=TlsConfig(**spec["tls"]), max_queued=0)
c.start()
assert c.wait_connected(10), c.last_error
for t, p in spec["once"]:
    assert c.publish(t, bytes.fromhex(p), qos=1).wait(10)
time.sleep(spec.get("pause", 0))
sent, end, last = 0, time.monotonic() + spec["seconds"], None
while time.monotonic() < end:
    for t, p in frames:
        last = c.publish(t, p, qos=1)
        sent += 1
        if sent % 1000 == 0:
            last.wait(30)
if last is not None:
    last.wait(30)
c.stop()
print(json.dumps({"sent": sent}), flush=True)
"""


@dataclass
class Site:
    site: LocalSite
    agents: list[subprocess.Popen[bytes]]
    root: Path

    def evil_tls(self) -> dict[str, str]:
        from edge_agent.credentials import tls_config
        t = tls_config(self.root / EVIL, "fog-default")
        return {"ca_file": str(t.ca_file), "cert_file": str(t.cert_file), "key_file": str(t.key_file),
                "server_hostname": str(t.server_hostname)}


def _flood(site: Site, client_id: str, tls: dict[str, str], frames: list[tuple[str, bytes]],
           once: tuple[tuple[str, bytes], ...] = (), pause: float = 0.0) -> subprocess.Popen[str]:
    spec = {"client_id": client_id, "port": site.site.port, "tls": tls, "seconds": FLOOD_S, "pause": pause,
            "frames": [(t, p.hex()) for t, p in frames], "once": [(t, p.hex()) for t, p in once]}
    path = site.root / f"flood-{client_id}-{time.time_ns()}.json"
    path.write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, "-c", FLOODER, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def _finish(proc: subprocess.Popen[str]) -> int:
    out, err = proc.communicate(timeout=FLOOD_S + 60)
    assert proc.returncode == 0, err[-2000:]
    return int(json.loads(out.strip().splitlines()[-1])["sent"])


@dataclass
class Probe:
    """One identity asking for status (and optionally inferring) in a loop, on its own connection."""

    site: LocalSite
    name: str
    infer: bool = False
    period: float = 0.25
    samples: list[tuple[float, float, dict[str, Any]]] = field(default_factory=list)  # (at, took, status)
    errors: list[str] = field(default_factory=list)
    inferences: list[tuple[float, str]] = field(default_factory=list)  # (took, "ok" | error)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _status(self) -> None:
        with self.site.client(self.name) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    st = c.status(timeout=15)
                    self.samples.append((t0, time.monotonic() - t0, st))
                except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(self.period)

    def _infer(self) -> None:
        x = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)
        with self.site.client() as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    c.infer("w", {"x": x}, timeout=5)
                    self.inferences.append((time.monotonic() - t0, "ok"))
                except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
                    self.inferences.append((time.monotonic() - t0, f"{type(exc).__name__}: {exc}"))
                self._stop.wait(0.5)

    def __enter__(self) -> Probe:
        for fn in [self._status] + ([self._infer] if self.infer else []):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from edge_agent.enrol import enrol_dirs
    root = tmp_path_factory.mktemp("flood-id")
    s = LocalSite(root / "fog").start()
    agents: list[subprocess.Popen[bytes]] = []
    try:
        s.issue("watch")
        s.issue(APP, "app")
        for dev in REAL:
            with open(root / f"{dev}.log", "wb") as log:
                agents.append(subprocess.Popen(
                    s.agent_argv(dev, root / dev, "--threads", "1", "--state-interval", "1",
                                 "--labels", "role=real"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        for dev in REAL:
            wait_status(root / dev, lambda st: st.get("phase") == "online", timeout=60)
        with s.client() as c:
            c.deploy({"name": "w", "model": "zoo:mlp", "source": "dev-a", "sink": "dev-a",
                      "selectors": {"role": "real"}})
            c.wait_running("w", 60)
        enrol_dirs(s.token(), [(EVIL, root / EVIL)], "127.0.0.1", int(s.enroll.rsplit(":", 1)[1]), timeout_s=30)
        yield Site(s, agents, root)
    finally:
        for a in agents:
            kill(a)
        s.stop()


def _alive(st: dict[str, Any]) -> set[str]:
    return {d["id"] for d in st["devices"] if d["alive"]}


def test_a_device_replaying_its_state_kills_no_one_and_is_quarantined(site: Site) -> None:
    from runtime.messages import DeviceBirth, DeviceState
    from runtime.security import Identity, Signer
    from runtime.topics import Topics
    t = Topics("default")
    ident = Identity.load(EVIL, site.root / EVIL / "agent.key")
    signer = Signer(ident, int(time.time()))
    now = time.time()
    birth = signer.seal_bytes(DeviceBirth(EVIL, signer.epoch, 0, "default", ident.public_key_bytes, 1e9, 1 << 30,
                                          1e8, 1e8, 0.001, 5.0, 2.0, state_interval_s=1.0), now)
    state = signer.seal_bytes(DeviceState(EVIL, signer.epoch, 1, 1 << 29), now)  # one signed state, replayed
    with site.site.client("watch") as c:
        wait_for("the three real devices alive", lambda: set(REAL) <= _alive(c.status()), 30)
    with Probe(site.site, "watch", infer=True) as probe:
        flooder = _flood(site, EVIL, site.evil_tls(), [(t.device(EVIL, "STATE"), state)],
                         once=((t.device(EVIL, "BIRTH"), birth), (t.device(EVIL, "STATE"), state)))
        sent = _finish(flooder)
        probe._stop.wait(5.0)  # and 5 s after it: the liveness timeout is 3 missed states of 1 s
    assert sent > 20_000, f"the flood was too slow to prove anything ({sent} in {FLOOD_S:g} s)"
    assert not probe.errors, probe.errors[:3]
    assert len(probe.samples) > 20
    dead = [(round(at - probe.samples[0][0], 1), sorted(set(REAL) - _alive(st))) for at, _, st in probe.samples
            if not set(REAL) <= _alive(st)]
    assert not dead, f"real devices declared dead during the flood (s, ids): {dead[:5]}"
    bad = [r for r in probe.inferences if r[1] != "ok"]
    assert len(probe.inferences) > 10 and not bad, f"{len(bad)} of {len(probe.inferences)} failed: {bad[:3]}"
    last = probe.samples[-1][2]
    lost = [e for e in last["events"] if e["kind"] == "device lost" and e["device"] in REAL]
    assert not lost, lost
    lim = last["limits"]["devices"]
    assert EVIL in lim["quarantined"], lim
    assert lim["quarantined"][EVIL]["reason"].startswith("flooding: "), lim
    ctr = last["counters"]
    assert ctr.get("limited:quarantined", 0) + ctr.get("limited:STATE", 0) == lim["dropped"][EVIL] >= 500, lim
    # once quarantined its writes left the ACL: the broker, not the fog, absorbed the rest of the flood
    assert lim["dropped"][EVIL] < 0.5 * sent, (lim, sent)
    assert any(e["kind"] == "quarantined" and e["device"] == EVIL for e in last["events"]), last["events"]
    assert ctr.get("verify_overflow", 0) == 0 and ctr.get("inbox_overflow", 0) == 0
    # fogline status says so in words
    from fog_broker.service_cli import render_status
    assert f"Quarantined:  {EVIL} (devices): flooding: " in render_status(last)


def test_an_app_flooding_control_does_not_stall_others_status(site: Site) -> None:
    from runtime.credentials import load_credentials
    from runtime.messages import ControlRequest
    from runtime.security import Signer
    from runtime.topics import Topics
    t = Topics("default")
    creds = load_credentials(site.site.credentials(APP))
    signer = Signer(creds.signing, time.time_ns() // 1_000_000)
    now = time.time()
    frames = [(t.control(APP), signer.seal_bytes(ControlRequest(f"r{i}", "hello", t.reply(APP)), now))
              for i in range(3000)]  # fresh, validly signed requests (the cycle replays them after that)
    tls = creds.tls_for("fog-default")
    tls_d = {"ca_file": str(tls.ca_file), "cert_file": str(tls.cert_file), "key_file": str(tls.key_file),
             "server_hostname": str(tls.server_hostname)}
    with Probe(site.site, "watch", period=0.1) as probe:
        probe._stop.wait(2.0)  # a baseline before the flood
        flooder = _flood(site, APP, tls_d, frames)
        sent = _finish(flooder)
    assert sent > 20_000, f"the flood was too slow to prove anything ({sent} in {FLOOD_S:g} s)"
    assert not probe.errors, probe.errors[:3]
    took = sorted(x for _, x, _ in probe.samples)
    assert len(took) > 30, len(took)
    assert took[-1] < 1.0, f"status took up to {took[-1]:.2f} s during the flood (p50 {took[len(took) // 2]:.3f} s)"
    lim = probe.samples[-1][2]["limits"]["control"]
    assert APP in lim["quarantined"] and lim["quarantined"][APP]["reason"].startswith("flooding: "), lim
    assert "watch" not in lim["dropped"], lim
    assert lim["dropped"][APP] < 0.5 * sent, (lim, sent)  # the broker absorbed the rest (ACL)
